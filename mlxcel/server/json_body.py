"""Reading a request's JSON body: the one place every JSON body the server takes is parsed.

`read_json_body` (and `decode_json_body` under it) answers 400 `invalid_request_error` for a
body that is not JSON, is nested more than `MAX_JSON_DEPTH` levels, or holds a string that
is not valid Unicode (a lone UTF-16 surrogate such as `"\\ud800"`: valid JSON, but no text,
and the tokenizers and the UTF-8 encoder refuse it). Routes read their body through it,
directly (`openai_common.parse_body`, /props, ...) or, for routes whose body FastAPI parses
into a typed parameter, through `JsonBodyRoute` on their router.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.errors import APIError, bad_request
from mlxcel.server.json_blobs import lift_blobs, restore_blobs
from mlxcel.server.media.offload import off_loop

MAX_JSON_DEPTH = 128
"""Deepest nesting of arrays and objects a request body may have (a JSON schema in a
request needs a few dozen levels at most); deeper is a 400 before the route sees it."""

OFF_LOOP_BYTES = 1 << 16
"""Bodies this large are decoded off the event loop (a chat message with a picture)."""

# Only a `\u` escape of a UTF-16 surrogate (D800-DFFF) in the raw body can give a decoded
# string a lone surrogate, so only then are the strings checked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_FORM_TYPES = ("multipart/",)  # a urlencoded body is JSON here, as llama-server reads it
_CONTAINERS = frozenset({dict, list})


def decode_json_body(raw: bytes, what: str = "request body") -> Any:
    """The JSON value of `raw`; APIError 400 naming the problem when it is not acceptable
    (`what` names the JSON in the message: JSON a client sent inside a field, too)."""
    raw, blobs = lift_blobs(raw)  # megabytes of base64 are not scanned by the parser
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise _too_deep(what) from None
    except (ValueError, UnicodeDecodeError):
        raise bad_request(f"{what} is not valid JSON") from None
    if _nested_too_deeply(payload):
        raise _too_deep(what)
    if _SURROGATE_ESCAPE.search(raw):  # a lifted string holds no escape
        _check_strings(payload, what)
    return restore_blobs(payload, blobs)


async def read_json_body(request: Request) -> Any:
    """The request's body decoded by `decode_json_body` (the body is read once); a large
    body is decoded on the media pool, not on the event loop."""
    raw = await request.body()
    if len(raw) >= OFF_LOOP_BYTES:
        return await off_loop(decode_json_body, raw)
    return decode_json_body(raw)


def _too_deep(what: str) -> APIError:
    return bad_request(
        f"{what} is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects"
    )


def _nested_too_deeply(payload: Any) -> bool:
    """Whether `payload` nests arrays and objects more than MAX_JSON_DEPTH levels, one
    level at a time (no recursion); a container of scalars only is skipped at C speed."""
    level = [payload] if type(payload) in _CONTAINERS else []
    for _ in range(MAX_JSON_DEPTH):
        deeper: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            if not _CONTAINERS.isdisjoint(map(type, children)):
                deeper.extend(c for c in children if type(c) in _CONTAINERS)
        if not deeper:
            return False
        level = deeper
    return True


def _check_strings(payload: Any, what: str) -> None:
    """400 for the first string or object key of `payload` holding a lone surrogate,
    naming where it is (walked without recursion)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(payload, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                _check_text(node, path, what)
            continue
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        for key, child in children:
            if isinstance(key, str) and not key.isascii():
                _check_text(key, path, what)
            if isinstance(child, (str, dict, list)):
                stack.append((child, (*path, key)))


def _check_text(text: str, path: tuple[str | int, ...], what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        where = f" at {_location(path)}" if path else ""
        raise bad_request(
            f"{what} is not valid Unicode: the string{where} holds a lone surrogate "
            f"\\u{code:04x} (half of a UTF-16 pair); pair a \\ud800-\\udbff escape with a "
            "\\udc00-\\udfff one or send the character itself"
        ) from None


def _location(path: tuple[str | int, ...]) -> str:
    """`messages[0].content` for ('messages', 0, 'content')."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class _ParsedJsonRequest(Request):
    """A request whose `json()` is the payload `read_json_body` already decoded."""

    payload: Any = None

    async def json(self) -> Any:
        return self.payload


class JsonBodyRoute(APIRoute):
    """A route whose typed JSON body parameter FastAPI fills from `read_json_body`, so the
    body gets the same limits and 400s as every other route's, and is JSON whatever its
    Content-Type (as llama-server reads bodies; `curl -d` sends a urlencoded type). Multipart
    bodies pass as they are. Use it as the router's `route_class`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def parsed_first(request: Request) -> Response:
            content_type = request.headers.get("content-type", "").lower()
            if content_type.startswith(_FORM_TYPES):
                return await handler(request)
            # JSON whatever the type said (FastAPI fills a typed body from JSON types only)
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
            parsed = _ParsedJsonRequest(scope, request.receive)
            if (await parsed.body()).strip():
                parsed.payload = await read_json_body(parsed)
            return await handler(parsed)

        return parsed_first
