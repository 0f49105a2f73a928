"""Errors in the OpenAI error shape, for every 4xx/5xx the server sends.

The Anthropic Messages routes (`/v1/messages`, `/v1/messages/count_tokens` and their aliases,
under `--api-prefix`) answer in Anthropic's shape instead, with the same status codes:
`{"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import Scope

from mlxcel.server.sse import sse_data

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = "1"

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.\-~]+){2,}[\\/]?")


def scrub_paths(message: str) -> str:
    """`message` with anything shaped like a file-system path replaced by `<path>`."""
    return _PATH.sub("<path>", message)


class APIError(Exception):
    """An error answer: status code, OpenAI `type`, one-line message."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}


def bad_request(message: str, *, code: str | None = None) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, "invalid_request_error", code=code)


def context_too_long(exc: Exception) -> APIError:
    """400 `context_length_exceeded` for an engine `ContextLengthError`, with llama-server's
    `n_prompt_tokens` and `n_ctx` in the error object when the engine knows them."""
    extra = {
        name: value
        for name in ("n_prompt_tokens", "n_ctx")
        if isinstance(value := getattr(exc, name, None), int)
    }
    return APIError(
        400, str(exc), "invalid_request_error", code="context_length_exceeded", extra=extra
    )


def server_busy(message: str = "All slots are busy. Please try again later.") -> APIError:
    """503 server_busy with Retry-After, so a load balancer can retry safely."""
    return APIError(503, message, "server_busy", headers={"Retry-After": RETRY_AFTER_SECONDS})


MODEL_LOADING = "Loading model"
"""The message of the 503 a request gets while its model loads."""


def model_loading() -> APIError:
    """503 server_busy while the model a route needs is loading (the spec's type for it)."""
    return server_busy(MODEL_LOADING)


def timeout_error(message: str) -> APIError:
    """504 timeout_error: the request did not finish within its deadline."""
    return APIError(504, message, "timeout_error")


def not_implemented(message: str) -> APIError:
    """501 not_implemented: no model on this server handles the route."""
    return APIError(501, message, "not_implemented")


def memory_budget_exceeded(estimated_bytes: int, budget_bytes: int, message: str) -> APIError:
    """503 request_memory_budget_exceeded with the spec's `estimated_bytes`/`budget_bytes`."""
    return APIError(
        503,
        message,
        "request_memory_budget_exceeded",
        code="request_memory_budget_exceeded",
        headers={"Retry-After": RETRY_AFTER_SECONDS},
        extra={"estimated_bytes": estimated_bytes, "budget_bytes": budget_bytes},
    )


def error_body(message: str, type: str, code: str | None = None, **extra: Any) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "code": code, **extra}}


MESSAGES_ROUTES = frozenset(
    {"/v1/messages", "/messages", "/v1/messages/count_tokens", "/messages/count_tokens"}
)
"""The Anthropic Messages routes (below the API prefix): their errors use Anthropic's shape."""

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str, prefix: str = "") -> bool:
    """Whether `path` is a Messages route under `prefix` (`/segment` or '')."""
    path = path.rstrip("/")
    if prefix:
        if not path.startswith(f"{prefix}/"):
            return False
        path = path[len(prefix) :]
    return path in MESSAGES_ROUTES


def anthropic_scope(scope: Scope) -> bool:
    """Whether the request of `scope` gets Anthropic-shaped errors (the app's prefix applied)."""
    state = getattr(getattr(scope.get("app"), "state", None), "mlxcel", None)
    raw_prefix = getattr(getattr(state, "settings", None), "api_prefix", None)
    text = raw_prefix.strip().strip("/") if isinstance(raw_prefix, str) else ""
    return is_messages_path(str(scope.get("path", "")), f"/{text}" if text else "")


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status."""
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """The Anthropic error object for a `status` answer."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_response(error: APIError, *, anthropic: bool = False) -> JSONResponse:
    """A JSON response for `error` (in Anthropic's shape when `anthropic`)."""
    body = (
        anthropic_error_body(error.message, error.status)
        if anthropic
        else error_body(error.message, error.type, error.code, **error.extra)
    )
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def sse_error_data(error: APIError) -> str:
    """`error` as one SSE `data:` event in the OpenAI error shape: how the OpenAI routes
    tell a failure after their stream has started (the OpenAI SDKs raise on it)."""
    body = error_body(error.message, error.type, error.code, **error.extra)
    return sse_data(body)


_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    501: "not_supported_error",
    503: "server_busy",
}


# What a pydantic type error expects, in JSON's words.
_EXPECTED = {
    "string_type": "a string",
    "list_type": "an array",
    "tuple_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
}


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    return "an object" if isinstance(value, Mapping) else type(value).__name__


def _validation_message(exc: RequestValidationError) -> str:
    """One line: where the body is wrong and what that field accepts.

    A field that accepts several types (`input`: a string or an array) fails once per
    type; those failures become one "must be a string or an array (got a number)".
    """
    errors = exc.errors()
    if not errors:
        return "invalid request body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON"
    loc = tuple(first.get("loc", ()))
    siblings = [e for e in errors if len(loc) > 1 and tuple(e.get("loc", ()))[:-1] == loc[:-1]]
    union = len(siblings) > 1 and all(
        str(e.get("type")) in _EXPECTED and e.get("input") is first.get("input") for e in siblings
    )
    if union:
        loc = loc[:-1]
    where = ".".join(str(p) for p in loc if p != "body")
    kinds = [_EXPECTED.get(str(e.get("type"))) for e in (siblings if union else [first])]
    if all(kinds):
        accepted = " or ".join(dict.fromkeys(k for k in kinds if k))
        message = f"must be {accepted}"
        if "input" in first:  # absent where the route keeps request values out of errors
            message += f" (got {_json_kind(first['input'])})"
    else:
        message = str(first.get("msg", "invalid value"))
    return f"{where}: {message}" if where else message


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the server sends use the OpenAI shape (400, never 422), or the
    Anthropic shape on the Messages routes."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, anthropic=anthropic_scope(request.scope))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(
            bad_request(_validation_message(exc)), anthropic=anthropic_scope(request.scope)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 404:
            message = "route not found"
        elif status == 405:
            message = "method not allowed for this route"
        else:
            message = str(exc.detail)
        return error_response(
            APIError(
                status,
                message,
                _STATUS_TYPES.get(status, "server_error"),
                headers=dict(exc.headers or {}),
            ),
            anthropic=anthropic_scope(request.scope),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Never leak paths or tracebacks to the client: the type name is enough for a bug
        # report; the operator's log gets the traceback. The server closes the connection
        # after an unexpected error: say so to the client.
        if not isinstance(exc, ClientDisconnect):  # the client left: nothing went wrong
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(
            APIError(
                500,
                f"internal error ({type(exc).__name__})",
                "server_error",
                headers={"Connection": "close"},
            ),
            anthropic=anthropic_scope(request.scope),
        )


def scope_error(
    scope: Scope, status: int, message: str, type: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error response for middleware (before routing): the Anthropic shape on the
    Messages routes, the OpenAI shape elsewhere."""
    body = (
        anthropic_error_body(message, status)
        if anthropic_scope(scope)
        else error_body(message, type)
    )
    return JSONResponse(body, status_code=status, headers=headers)
