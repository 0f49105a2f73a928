"""The request guard: header and body size caps, API-key auth and the loading gate.

One pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide client
disconnects). Checks run in this order, each answering in the OpenAI error shape (the
Anthropic shape on the Messages routes, whose SDK sends its key as `x-api-key`):

1. a request head (URL and headers) over `max_header_bytes` -> 431, or 414 when the URL
   alone is over it;
2. with API keys configured, every path but the public ones (`/health`, `/`) and the
   keyless ones (`/models`, `/v1/models`, public in llama-server) needs
   `Authorization: Bearer <key>` (or the raw key, or `X-Api-Key`) -> 401
   `missing_api_key` / `invalid_api_key`; keys are compared in constant time and never
   read from the query string;
3. while the model loads, everything but the public paths -> 503 `server_busy`;
4. bodies over `max_body_size` -> 413, from `Content-Length` at once, or while reading a
   body sent without one (chunked), before the application sees any of it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxcel.server.errors import MODEL_LOADING, RETRY_AFTER_SECONDS, scope_error

MAX_HEADER_BYTES = 32 * 1024
"""Largest request head (request line and headers) accepted; larger gets 431."""


class ApiKeys:
    """The accepted API keys; `check` says which 401 a request earns, if any."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [k.encode("utf-8") for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _matches(self, candidate: str) -> bool:
        given = candidate.encode("utf-8")
        # Compare against every key (no short-circuit), each in constant time.
        results = [hmac.compare_digest(given, key) for key in self._keys]
        return any(results)

    def check(self, authorization: str | None, x_api_key: str | None) -> str | None:
        """None when the request may pass, else the error type: missing or invalid key."""
        if not self._keys:
            return None
        candidates: list[str] = []
        if authorization:
            scheme, _, rest = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                candidates.append(rest.strip())
            else:
                candidates.append(authorization.strip())
        if x_api_key:
            candidates.append(x_api_key.strip())
        if not candidates:
            return "missing_api_key"
        return None if any([self._matches(c) for c in candidates]) else "invalid_api_key"


class RequestGuard:
    """ASGI middleware applying the size caps, auth and the loading gate (see module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: ApiKeys,
        public_paths: Iterable[str],
        max_body_size: int,
        keyless_paths: Iterable[str] = (),
        is_loading: Callable[[], bool] = lambda: False,
        upload_paths: frozenset[str] = frozenset(),
        upload_max_body_size: int = 0,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.api_keys = api_keys
        self.public_paths = frozenset(public_paths)
        self.keyless_paths = frozenset(keyless_paths)
        self.max_body_size = max_body_size
        self.upload_paths = upload_paths
        self.upload_max_body_size = upload_max_body_size
        self.is_loading = is_loading
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers") or []
        target = len(scope.get("raw_path") or scope["path"].encode()) + len(
            scope.get("query_string") or b""
        )
        head_size = target + sum(len(k) + len(v) + 4 for k, v in headers)
        if head_size > self.max_header_bytes:
            too_long = target > self.max_header_bytes  # the URL alone: 414, as llama-server
            what = "request URI too long" if too_long else "request headers too large"
            response = scope_error(
                scope,
                414 if too_long else 431,
                f"{what}: the limit is {self.max_header_bytes} bytes",
                "invalid_request_error",
            )
            await response(scope, receive, send)
            return
        lookup = _header_lookup(headers)
        public = scope["path"] in self.public_paths
        keyless = public or scope["path"] in self.keyless_paths
        if not keyless and self.api_keys.enabled:
            failure = self.api_keys.check(lookup("authorization"), lookup("x-api-key"))
            if failure is not None:
                message = "Missing API key" if failure == "missing_api_key" else "Invalid API Key"
                await scope_error(scope, 401, message, failure)(scope, receive, send)
                return
        if not public and self.is_loading():
            response = scope_error(
                scope, 503, MODEL_LOADING, "server_busy", {"Retry-After": RETRY_AFTER_SECONDS}
            )
            await response(scope, receive, send)
            return
        await self._with_body_cap(scope, receive, send, lookup("content-length"))

    async def _with_body_cap(
        self, scope: Scope, receive: Receive, send: Send, content_length: str | None
    ) -> None:
        limit = self.max_body_size
        if scope["path"] in self.upload_paths:  # audio uploads may be up to 25 MiB
            limit = max(limit, self.upload_max_body_size)
        too_large = scope_error(
            scope,
            413,
            f"request body too large: the limit is {limit} bytes",
            "invalid_request_error",
        )
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                bad = scope_error(
                    scope, 400, "invalid Content-Length header", "invalid_request_error"
                )
                await bad(scope, receive, send)
                return
            if declared > limit:
                await too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read the body here, up to the cap, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([replayed], None, receive), send)


def _header_lookup(headers: list[tuple[bytes, bytes]]) -> Callable[[str], str | None]:
    def lookup(name: str) -> str | None:
        key = name.encode("latin-1")
        for k, v in headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None

    return lookup


def _replay(messages: list[Message], last: Message | None, receive: Receive) -> Receive:
    """A receive callable that yields `messages` (then `last`) before the real ones."""
    queue = list(messages) + ([last] if last is not None else [])

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


LOCALHOST_ORIGINS = "localhost"
"""The `--cors-origins` value that allows any origin on this machine (any scheme and port)."""
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_local_origin(origin: str) -> bool:
    """Whether an `Origin` header names this machine: localhost, 127.0.0.1 or [::1]."""
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 -- raises ValueError on a malformed port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or "@" in parts.netloc:
        return False
    return (parts.hostname or "") in _LOCAL_HOSTS


class Cors:
    """CORS as llama-server answers it (pure ASGI, outside the request guard).

    `origins` is `--cors-origins`: `*` (any origin; reflected when credentials are
    allowed), `localhost` (origins on this machine only), or a comma-separated list.
    Every OPTIONS request is answered here with 200 and the allow headers, before auth
    (browsers send preflights without credentials). A requested header list is echoed
    when `headers` is `*`, since browsers never let `*` cover `Authorization`.
    """

    def __init__(
        self, app: ASGIApp, *, origins: str, methods: str, headers: str, credentials: bool
    ) -> None:
        self.app = app
        self.origins = origins.strip()
        self.listed = frozenset(o.strip() for o in origins.split(",") if o.strip())
        self.methods = methods
        self.headers = headers
        self.credentials = credentials

    def allow_origin(self, origin: str | None) -> str | None:
        """The `Access-Control-Allow-Origin` value for a request from `origin`, if any."""
        if self.origins == "*":
            return origin if self.credentials and origin else "*"
        if not origin:
            return None
        if self.origins == LOCALHOST_ORIGINS:
            return origin if is_local_origin(origin) else None
        return origin if origin in self.listed else None

    def _cors_headers(self, origin: str | None) -> list[tuple[bytes, bytes]]:
        allowed = self.allow_origin(origin)
        out: list[tuple[bytes, bytes]] = []
        if allowed is not None:
            out.append((b"Access-Control-Allow-Origin", allowed.encode("latin-1")))
            if self.credentials:
                out.append((b"Access-Control-Allow-Credentials", b"true"))
            if allowed != "*":
                out.append((b"Vary", b"Origin"))
        return out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lookup = _header_lookup(scope.get("headers") or [])
        origin = lookup("origin")
        if scope.get("method") == "OPTIONS":
            await self._preflight(origin, lookup("access-control-request-headers"), send)
            return
        extra = self._cors_headers(origin)
        if not extra:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                names = {name for name, _ in extra}
                kept = [h for h in message.get("headers", []) if h[0].title() not in names]
                message["headers"] = kept + extra
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, origin: str | None, requested: str | None, send: Send) -> None:
        headers = self._cors_headers(origin)
        if not self.credentials and headers:
            headers.append((b"Access-Control-Allow-Credentials", b"false"))
        allow_headers = requested if self.headers.strip() == "*" and requested else self.headers
        headers += [
            (b"Access-Control-Allow-Methods", self.methods.encode("latin-1")),
            (b"Access-Control-Allow-Headers", allow_headers.encode("latin-1")),
            (b"Content-Length", b"0"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
