"""Waking a sleeping model (`--sleep-idle-seconds`) for the requests that need it.

The engine unloads its model after an idle spell (`mlxcel.engine.text.sleep`). As in
llama-server, a few routes answer from what the server keeps while the model sleeps and
leave it asleep: `GET /health` (and `/`), `GET /props` (which says `is_sleeping: true`)
and the model list and objects (`/v1/models`, `/v1/models/{id}`). Every other route of the
text model (generation, `/tokenize`, `/detokenize`, `/apply-template`, `/slots`, `/metrics`,
...) first waits for the engine to load the model again: concurrent requests all wait for
the one reload, then run normally.
The side workers' routes (embeddings and rerank models, audio, images) never wake it, nor
does a request that no route takes (404, 405).
A reload that fails answers 503 and leaves the model asleep for the next request to retry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel.server.bridge import await_engine
from mlxcel.server.errors import RETRY_AFTER_SECONDS, scope_error

if TYPE_CHECKING:
    from mlxcel.server.engine_protocol import GenerationEngine

_WHILE_ASLEEP = {
    "GET": ("/health", "/", "/props", "/models", "/v1/models"),
    "HEAD": ("/health", "/"),
}
"""Routes (under the API prefix) that answer without waking the model."""

_MODEL_OBJECTS = ("/models/", "/v1/models/")
"""`GET /v1/models/{id}`: answered from what the server keeps, like the model list."""

_SIDE_WORKERS = (
    "/v1/embeddings",
    "/embedding",
    "/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/rerank",
    "/reranking",
    "/v1/audio/",
    "/audio/",
    "/v1/images/",
    "/images/",
)
"""Routes served by their own workers: the text model's sleep is not theirs."""


def wakes_model(method: str, path: str, prefix: str = "") -> bool:
    """Whether a `method` request for `path` needs the sleeping text model awake."""
    if prefix:
        if not path.startswith(prefix):
            return False  # no route there: a 404
        path = path[len(prefix) :] or "/"
    if path in _WHILE_ASLEEP.get(method, ()):
        return False
    if method == "GET" and path.startswith(_MODEL_OBJECTS):
        return False
    return not any(
        path == route or (route.endswith("/") and path.startswith(route)) for route in _SIDE_WORKERS
    )


class WakeOnRequest:
    """ASGI middleware: a request that needs the model waits until a sleeping engine woke."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        engine: Callable[[], GenerationEngine | None],
        prefix: str = "",
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        self.app = app
        self.engine = engine  # the text engine now, or None (loading, no text model)
        self.prefix = prefix
        self.routes = routes  # the app's routes: a 404 or 405 never wakes the model

    def _routed(self, scope: Scope) -> bool:
        if not self.routes:
            return True
        return any(route.matches(scope)[0] is Match.FULL for route in self.routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            engine = self.engine()
            if (
                engine is not None
                and engine.sleeping
                and wakes_model(scope.get("method", "GET"), scope["path"], self.prefix)
                and self._routed(scope)
            ):
                try:
                    await await_engine(engine.wake, None)
                except Exception as exc:  # noqa: BLE001 - answered as a 503, model asleep
                    response = scope_error(
                        scope,
                        503,
                        str(exc) or "the model could not be reloaded",
                        "server_busy",
                        {"Retry-After": RETRY_AFTER_SECONDS},
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
