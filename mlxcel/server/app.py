"""The FastAPI application: routers, error handlers, auth, CORS and size limits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypedDict

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from mlxcel.server.audio.protocol import MAX_BODY_BYTES
from mlxcel.server.audio.routes import UPLOAD_PATHS
from mlxcel.server.errors import install_error_handlers
from mlxcel.server.io_timeout import IoTimeout
from mlxcel.server.middleware import MAX_HEADER_BYTES, ApiKeys, Cors, RequestGuard
from mlxcel.server.served_models import chat_model_wanted
from mlxcel.server.sleep import WakeOnRequest

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.server.state import ServerState

PUBLIC_ROUTES = ("/health", "/")
"""Paths (under the API prefix) that never need an API key, even while the model loads."""

KEYLESS_ROUTES = ("/models", "/v1/models")
"""Paths (under the API prefix) that need no API key but wait for the model, as
llama-server's public endpoints (`/health`, `/models`, `/v1/models`, its web UI)."""


def normalize_prefix(prefix: str | None) -> str:
    """`--api-prefix` as `/segment` (leading slash, no trailing one), or ''."""
    text = (prefix or "").strip().strip("/")
    return f"/{text}" if text else ""


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _routers() -> list[APIRouter]:
    from mlxcel.server.anthropic_messages.routes import router as messages_router
    from mlxcel.server.audio import router as audio_router
    from mlxcel.server.embeddings.routes import router as embeddings_router
    from mlxcel.server.health import router as health_router
    from mlxcel.server.images import router as images_router
    from mlxcel.server.llama_native.routes import router as native_router
    from mlxcel.server.models_route import router as models_router
    from mlxcel.server.openai_chat.routes import router as chat_router
    from mlxcel.server.openai_completions.routes import router as completions_router
    from mlxcel.server.openai_responses.routes import router as responses_router
    from mlxcel.server.ops.routes import router as ops_router
    from mlxcel.server.realtime import router as realtime_router
    from mlxcel.server.rerank.routes import router as rerank_router

    return [
        health_router,
        models_router,
        chat_router,
        completions_router,
        responses_router,
        messages_router,
        native_router,
        ops_router,
        embeddings_router,
        rerank_router,
        audio_router,
        images_router,
        realtime_router,
    ]


def public_paths(prefix: str) -> set[str]:
    """The unauthenticated paths for `prefix` (`/health`, `/`, and the bare prefix)."""
    paths = {f"{prefix}{route}" for route in PUBLIC_ROUTES}
    if prefix:
        paths.add(prefix)
    return paths


class GuardOptions(TypedDict):
    """`RequestGuard`'s options from the settings: API keys, open paths, body caps."""

    api_keys: ApiKeys
    public_paths: set[str]
    keyless_paths: frozenset[str]
    max_body_size: int
    upload_paths: frozenset[str]
    upload_max_body_size: int


def guard_options(settings: Settings, prefix: str) -> GuardOptions:
    """The request guard's options for a server under `prefix`."""
    return GuardOptions(
        api_keys=ApiKeys(settings.api_keys()),
        public_paths=public_paths(prefix),
        keyless_paths=frozenset(f"{prefix}{route}" for route in KEYLESS_ROUTES),
        max_body_size=settings.max_body_size,
        upload_paths=frozenset(f"{prefix}{path}" for path in UPLOAD_PATHS),
        upload_max_body_size=max(settings.max_body_size, MAX_BODY_BYTES),
    )


def cors_options(settings: Settings) -> dict[str, str | bool] | None:
    """`Cors`'s options from `--cors-origins/methods/headers/credentials` (None: no CORS)."""
    if not _split(settings.cors_origins):
        return None
    return {
        "origins": settings.cors_origins,
        "methods": settings.cors_methods or "GET, POST, DELETE, OPTIONS",
        "headers": settings.cors_headers or "*",
        "credentials": bool(settings.cors_credentials),
    }


def add_cors(app: FastAPI, settings: Settings) -> None:
    """CORS from `--cors-origins/methods/headers/credentials`, as llama-server applies them."""
    options = cors_options(settings)
    if options is not None:
        app.add_middleware(Cors, **options)  # type: ignore[arg-type]


def _include_no_chat_model_routes(app: FastAPI, settings: Settings, prefix: str) -> None:
    """501 stubs for the text model's routes on a server without a chat model, included
    before the real routes so that they win route matching. An audio-only or image-only
    server's chat and completion routes name the routes it serves; every other text route
    (and every one on a server with other side models too) names what it serves."""
    from mlxcel.server.no_chat_model import no_chat_model_router, served_uses

    uses = set(served_uses(settings))
    if uses and uses <= {"transcription", "speech"}:
        from mlxcel.server.audio import audio_only_router

        served = SimpleNamespace(has_stt="transcription" in uses, has_tts="speech" in uses)
        app.include_router(audio_only_router(served), prefix=prefix)  # type: ignore[arg-type]
    elif uses == {"images"}:
        from mlxcel.server.images import image_only_router

        app.include_router(image_only_router(), prefix=prefix)
    app.include_router(no_chat_model_router(_routers(), settings), prefix=prefix)


def answer_head(router: APIRouter) -> None:
    """Every GET route of `router` answers HEAD too (the GET's status and headers, no
    body), as llama-server's HTTP library does; FastAPI answered 405, and probes send
    `HEAD /health`. Before the router is included: the app keeps its own view of it. The
    API document leaves these HEADs out (`_document_without_head`): HEAD mirrors GET."""
    for route in router.routes:
        if isinstance(route, APIRoute) and route.methods and "GET" in route.methods:
            route.methods.add("HEAD")


def _document_without_head(app: FastAPI) -> None:
    """`app.openapi()` without the HEAD operations `answer_head` adds: they have no body
    to describe, and a document listing them promises JSON answers they cannot carry."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        document = build()
        for operations in document.get("paths", {}).values():
            operations.pop("head", None)
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(state: ServerState, *, max_header_bytes: int = MAX_HEADER_BYTES) -> FastAPI:
    """Build the HTTP application around `state` (stored on `app.state.mlxcel`)."""
    settings = state.settings
    app = FastAPI(
        title="mlxcel",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.mlxcel = state
    install_error_handlers(app)
    prefix = normalize_prefix(settings.api_prefix)
    if not chat_model_wanted(settings):
        _include_no_chat_model_routes(app, settings, prefix)
    for router in _routers():
        answer_head(router)
        app.include_router(router, prefix=prefix)
    _document_without_head(app)
    # Middleware added last runs first: CORS (answers preflights), then the guard, then
    # the wake-up of a sleeping model (`--sleep-idle-seconds`) for the routes that need it.
    app.add_middleware(
        WakeOnRequest,
        engine=lambda: state.engine,
        prefix=prefix,
        routes=app.router.routes,
    )
    app.add_middleware(
        RequestGuard,
        **guard_options(settings, prefix),
        is_loading=lambda: state.loading,
        max_header_bytes=max_header_bytes,
    )
    add_cors(app, settings)
    app.add_middleware(IoTimeout, seconds=settings.timeout)  # outermost: every read and write
    return app
