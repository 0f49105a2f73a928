"""Route each request of a router server to its model's app.

A POST body names its model in `model` (a JSON body's field or a form's, as an upload
sends it; `?model=` otherwise), a GET in `?model=`. The name may be an alias. Before
anything loads, a request is refused (400, the OpenAI error shape, or Anthropic's on the
Messages routes) when it names no model, an unknown one (the message lists the models there
are), a model that cannot serve the route (an embedding model asked to chat), or a model
that is not loaded while autoload is off (`--no-models-autoload`, or `?autoload=false` on
the request). Otherwise the model is loaded if needed (the request waits for it, at most
`--timeout` seconds: 503 past that), and the request goes to the model's own app with its
body unchanged.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from mlxcel.config import Settings
from mlxcel.server.errors import (
    APIError,
    anthropic_scope,
    error_response,
    memory_budget_exceeded,
    scrub_paths,
    server_busy,
)
from mlxcel.server.json_body import decode_json_body
from mlxcel.server.realtime.routes import Sessions
from mlxcel.server.router.pool import (
    LoadFailed,
    MemoryRefused,
    ModelPool,
    ModelStatus,
    PoolFull,
    RoutedModel,
    Service,
)

_USE_BY_PATH = (
    (("/v1/embeddings", "/embedding", "/embeddings"), "embeddings"),
    (("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"), "rerank"),
    (
        (
            "/v1/audio/transcriptions",
            "/audio/transcriptions",
            "/v1/audio/translations",
            "/audio/translations",
        ),
        "transcription",
    ),
    (("/v1/audio/speech", "/audio/speech"), "speech"),
    (("/v1/images/", "/images/"), "images"),
)
REALTIME_PATHS = ("/v1/realtime", "/realtime")
_ANY_MODEL = ("/props", "/metrics", "/slots", "/v1/cache/stats", "/v1/cache/reset")
_USE_NAMES = {
    "chat": "chat and text generation",
    "embeddings": "embeddings",
    "rerank": "reranking",
    "transcription": "transcriptions",
    "speech": "speech",
    "images": "image generation",
}


def request_use(path: str) -> str | None:
    """What a route asks of its model: chat, embeddings, rerank, transcription, speech or
    images (None: any model answers it, as `/props`, `/metrics` and `/slots`)."""
    if path in _ANY_MODEL:
        return None
    for routes, use in _USE_BY_PATH:
        if any(path == r or (r.endswith("/") and path.startswith(r)) for r in routes):
            return use
    return "chat"


def unknown_model(name: str, pool: ModelPool) -> APIError:
    """400 `model_not_found`, naming the models there are."""
    available = ", ".join(pool.names()) or "none"
    shown = name if len(name) <= 200 else name[:200] + "..."
    return APIError(
        400,
        f"model '{shown}' not found; available models: {available}",
        code="model_not_found",
        extra={"param": "model"},
    )


def load_error(exc: BaseException, model: RoutedModel) -> APIError:
    """The answer to a load that did not happen."""
    if isinstance(exc, MemoryRefused):
        return memory_budget_exceeded(exc.needed, exc.budget, str(exc))
    if isinstance(exc, PoolFull):
        return server_busy(str(exc))
    if isinstance(exc, TimeoutError):
        return server_busy(f"model {model.entry.name} is still loading; try again later")
    if isinstance(exc, LoadFailed):
        return APIError(500, scrub_paths(str(exc)), "server_error")
    raise exc


async def checkout(pool: ModelPool, model: RoutedModel, timeout: float | None) -> Service:
    """`pool.checkout(model)` with each way a load can fail as its APIError."""
    try:
        return await pool.checkout(model, timeout)
    except (MemoryRefused, PoolFull, TimeoutError, LoadFailed) as exc:
        raise load_error(exc, model) from None


class RouterDispatch:
    """ASGI app: the router's own routes to `control`, every other request to its model."""

    def __init__(
        self,
        control: ASGIApp,
        pool: ModelPool,
        *,
        prefix: str = "",
        load_timeout: float | None = None,
        settings: Settings | None = None,
    ) -> None:
        """`settings` are the router's (API keys and limits of `/v1/realtime` sessions)."""
        self.control = control
        self.pool = pool
        self.prefix = prefix
        self.load_timeout = load_timeout
        self.settings = settings or Settings()
        self.realtime_sessions = Sessions()

    def _path(self, scope: Scope) -> str | None:
        path: str = scope["path"]
        if self.prefix:
            if not path.startswith(self.prefix):
                return None
            path = path[len(self.prefix) :] or "/"
        return path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = self._path(scope)
        query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
        if scope["type"] == "websocket" and path in REALTIME_PATHS:
            await self._realtime(WebSocket(scope, receive, send), query)
            return
        if scope["type"] != "http" or path is None or _router_route(scope, path, query):
            await self.control(scope, receive, send)
            return
        body: list[Message] = []
        try:
            name = await self._model_name(scope, receive, query, body)
            model = self._route(name, path, query)
            service = await checkout(self.pool, model, self.load_timeout)
        except APIError as error:
            await error_response(error, anthropic=anthropic_scope(scope))(scope, receive, send)
            return
        try:
            await service.app(scope, _replay(body, receive), send)
        finally:
            self.pool.release(model, service)

    async def _realtime(self, websocket: WebSocket, query: dict[str, list[str]]) -> None:
        from mlxcel.server.router.realtime import serve_realtime

        await serve_realtime(
            websocket,
            self.pool,
            lambda name, path: self._route(name, path, query),
            self.settings,
            self.realtime_sessions,
            self.load_timeout,
        )

    async def _model_name(
        self, scope: Scope, receive: Receive, query: dict[str, list[str]], body: list[Message]
    ) -> str:
        if scope.get("method") == "POST":
            chunks: list[bytes] = []
            while True:
                message = await receive()
                body.append(message)
                if message["type"] != "http.request":
                    break
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            raw = b"".join(chunks)
            if _is_form(scope):
                name = await _form_model(scope, raw)
                if name:
                    return name
            elif raw.strip():
                payload = decode_json_body(raw)
                if isinstance(payload, dict) and isinstance(payload.get("model"), str):
                    return str(payload["model"])
        names = query.get("model")
        if names and names[0]:
            return names[0]
        raise APIError(400, "model name is missing from the request", extra={"param": "model"})

    def _route(self, name: str, path: str, query: dict[str, list[str]]) -> RoutedModel:
        model = self.pool.find(name)
        if model is None:
            raise unknown_model(name, self.pool)
        use = request_use(path)
        if use is not None and use not in model.entry.kind.uses:
            able = [m.entry.name for m in self.pool.models if use in m.entry.kind.uses]
            others = f"; models that can: {', '.join(able)}" if able else ""
            raise APIError(
                400,
                f"model '{model.entry.name}' ({model.entry.kind.value}) cannot serve "
                f"{_USE_NAMES[use]}{others}",
                code="model_not_supported",
                extra={"param": "model"},
            )
        autoload = self.pool.autoload
        words = query.get("autoload")
        if words:
            autoload = words[0].strip().lower() in ("1", "true", "yes", "on")
        if not autoload and model.status in (ModelStatus.UNLOADED, ModelStatus.LOADING):
            raise APIError(
                400,
                f"model '{model.entry.name}' is not loaded (load it with POST /models/load)",
                code="model_not_loaded",
                extra={"param": "model"},
            )
        return model


def _router_route(scope: Scope, path: str, query: dict[str, list[str]]) -> bool:
    """Whether the router answers `path` itself."""
    method = scope.get("method", "GET")
    if path in ("/health", "/") and method in ("GET", "HEAD"):
        return True
    if path in ("/models", "/v1/models") or path.startswith(("/models/", "/v1/models/")):
        return True
    return path == "/props" and method == "GET" and not query.get("model")


def _is_form(scope: Scope) -> bool:
    """Whether the body is a form (an upload) rather than JSON."""
    for key, value in scope.get("headers") or []:
        if key.lower() == b"content-type":
            return b"multipart/form-data" in value.lower() or b"form-urlencoded" in value.lower()
    return False


async def _form_model(scope: Scope, raw: bytes) -> str | None:
    """The `model` field of a form body (None: none, or not a readable form)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    request = Request(scope, receive)
    try:
        form = await request.form(max_files=16, max_fields=64)
    except Exception:  # noqa: BLE001 - a malformed form: the route itself answers 400
        return None
    try:
        value = form.get("model")
        return value if isinstance(value, str) and value else None
    finally:
        await form.close()


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that gives `messages` first (the body read to find the model)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
