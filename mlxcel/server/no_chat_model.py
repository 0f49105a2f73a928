"""501 for the text model's routes on a server that runs no chat model.

An embeddings-only server (`--embedding`), or side models without `-m` (`--embedding-model`,
`--audio-model`, `--image-model`, ...), has no text engine: its chat, completion,
tokenization, template and slot routes would otherwise reach handlers that need one. As
llama-server in embedding mode ("This server does not support completions"), they answer
501 `not_supported_error`, naming what the server does serve. The model list, `/health`,
`/metrics` and the prompt-cache routes answer as usual (`/props` too needs the engine: 501);
the side workers' routes are theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.routing import APIRoute

from mlxcel.server.errors import APIError
from mlxcel.server.sleep import wakes_model

if TYPE_CHECKING:
    from mlxcel.config import Settings

_ANSWERED_ANYWAY = ("/metrics", "/v1/cache/stats", "/v1/cache/reset")
"""Routes of the text model that answer from counters (and a disabled cache) without it."""

_ENGINE_ROUTES = ("/props",)
"""Routes that answer a sleeping model without waking it, but need its engine."""


def served_uses(settings: Settings) -> list[str]:
    """What a server without a chat model serves, from its settings."""
    from mlxcel.server.embeddings.services import wanted_models

    want_emb, _, want_rr, _ = wanted_models(settings)
    uses = {
        "embeddings": want_emb,
        "reranking": want_rr,
        "transcription": bool(settings.audio_model),
        "speech": bool(settings.tts_model),
        "images": bool(settings.image_model),
    }
    return [use for use, wanted in uses.items() if wanted]


def no_chat_model_router(routers: Sequence[APIRouter], settings: Settings) -> APIRouter:
    """Stubs answering 501 for every route of `routers` that needs the text model; include
    it before `routers` so that its routes win."""
    uses = ", ".join(served_uses(settings)) or "no model routes"
    message = (
        f"This server runs no chat model (it serves {uses}); start it with -m MODEL, "
        "without --embedding, for this route"
    )

    async def unavailable() -> None:
        raise APIError(501, message, "not_implemented")

    stub = APIRouter()
    for router in routers:
        for route in router.routes:
            if not isinstance(route, APIRoute) or route.path in _ANSWERED_ANYWAY:
                continue
            needed = route.path in _ENGINE_ROUTES
            methods = sorted(m for m in route.methods or () if needed or wakes_model(m, route.path))
            if methods:
                stub.add_api_route(
                    route.path, unavailable, methods=methods, include_in_schema=False
                )
    return stub
