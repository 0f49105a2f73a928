"""`/v1/realtime` on a router: one session served by three routed models.

`?model=NAME` names the chat model (a name or an alias); the speech-to-text and the
text-to-speech models are the router's Whisper and Kokoro models (the first listed of each
kind, a loaded one first). All three are loaded as needed, as a request loads its model,
and held (never evicted, as a model serving a request) until the session ends, so the
router needs room for three models (`--models-max` 3 or more, or 0).

Refused before the upgrade, in the OpenAI error shape: 401 without a valid API key; 400 for
a missing or unknown model, a model that cannot chat, or one not loaded while autoload is
off; 501 naming what the router lacks (no Whisper or no Kokoro model); 503 when a model
cannot be loaded now (no room, the memory budget, still loading at `--timeout`), 500 when
it fails to load.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.websockets import WebSocket

from mlxcel.config import Settings
from mlxcel.server.errors import APIError, error_response
from mlxcel.server.realtime.routes import (
    Sessions,
    deny,
    key_refusal,
    refuse_full,
    run_session,
)
from mlxcel.server.router.dispatch import REALTIME_PATHS, checkout
from mlxcel.server.router.pool import ModelPool, ModelStatus, RoutedModel, Service

Route = Callable[[str, str], RoutedModel]
"""The dispatch's check of a model for a route: (name, path) -> the model, or APIError."""

_SIDE_MODELS = (
    ("transcription", "/v1/audio/transcriptions", "speech-to-text model (a Whisper model)"),
    ("speech", "/v1/audio/speech", "text-to-speech model (a Kokoro model)"),
)


def _side_model(pool: ModelPool, use: str) -> RoutedModel | None:
    """The model that serves `use` in a session: a loaded one first, else the first listed."""
    able = [m for m in pool.models if use in m.entry.kind.uses]
    loaded = [m for m in able if m.status in (ModelStatus.LOADED, ModelStatus.SLEEPING)]
    return (loaded or able)[0] if able else None


def session_models(pool: ModelPool, name: str | None, route: Route) -> list[RoutedModel]:
    """The chat, speech-to-text and text-to-speech models of a session (APIError)."""
    if not name:
        raise APIError(400, "model name is missing from the request", extra={"param": "model"})
    models = [route(name, REALTIME_PATHS[0])]
    missing = []
    for use, path, label in _SIDE_MODELS:
        model = _side_model(pool, use)
        if model is None:
            missing.append(label)
        else:
            models.append(route(model.entry.name, path))
    if missing:
        raise APIError(
            501,
            "/v1/realtime needs a chat model, a speech-to-text model and a text-to-speech "
            f"model; this router has no {', and no '.join(missing)} in its models "
            f"({', '.join(pool.names())})",
            "not_implemented",
        )
    return models


async def serve_realtime(
    websocket: WebSocket,
    pool: ModelPool,
    route: Route,
    settings: Settings,
    sessions: Sessions,
    load_timeout: float | None,
) -> None:
    """One realtime session of a router (see the module doc)."""
    refusal = key_refusal(websocket, settings)
    if refusal is not None:
        await deny(websocket, refusal)
        return
    if sessions.full(settings):  # before any model loads for it
        await refuse_full(websocket, settings)
        return
    held: list[tuple[RoutedModel, Service]] = []
    try:
        try:
            for model in session_models(pool, websocket.query_params.get("model"), route):
                held.append((model, await checkout(pool, model, load_timeout)))
        except APIError as error:
            await deny(websocket, error_response(error))
            return
        chat, stt, tts = (service.state for _, service in held)
        assert stt.audio is not None and tts.audio is not None
        await run_session(websocket, chat, stt.audio, tts.audio, sessions, settings)
    finally:
        for model, service in held:
            pool.release(model, service)
