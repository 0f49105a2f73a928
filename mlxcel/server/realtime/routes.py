"""`GET /v1/realtime` (and `/realtime`): OpenAI's Realtime protocol over a WebSocket, served
by a cascade of the server's models (Whisper → the chat model → Kokoro).

Before the upgrade (answered as HTTP, in the OpenAI error shape): 401 without a valid API
key when the server has keys (the `Authorization` or `X-Api-Key` header, or OpenAI's
browser form, the subprotocol `openai-insecure-api-key.<key>` next to `realtime`); 503 while
a model loads; 501 naming what is missing when the server lacks a chat model,
`--audio-model` or `--tts-model`. After it: a session past `--realtime-max-sessions` is
closed with 1013 (try again later); text frames carry JSON events, anything else is
answered with an `error` event; a session silent for `--realtime-idle-timeout` seconds is
closed with 1000; a client that goes away cancels its response and transcriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from mlxcel.server.errors import MODEL_LOADING, error_body
from mlxcel.server.middleware import ApiKeys
from mlxcel.server.no_chat_model import served_uses
from mlxcel.server.realtime.protocol import ClientEventError, error_event
from mlxcel.server.realtime.session import RealtimeSession, Send

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.workers.audio import AudioWorker
    from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

router = APIRouter()

SUBPROTOCOL = "realtime"
KEY_SUBPROTOCOL = "openai-insecure-api-key."
TRY_AGAIN_LATER = 1013
MAX_EVENT_CHARS = 16 * 1024 * 1024
"""Largest text frame read as an event (uvicorn's own frame limit is the same 16 MiB)."""


def missing_models(state: ServerState) -> list[str]:
    """What `/v1/realtime` lacks on this server, as the flags that would load it."""
    worker = state.audio
    missing = []
    if state.client is None and not state.loading:
        missing.append("chat model (-m MODEL)")
    if worker is None or not worker.stt_model:
        missing.append("speech-to-text model (--audio-model, e.g. default: Whisper tiny.en)")
    if worker is None or not worker.tts_model:
        missing.append("text-to-speech model (--tts-model KOKORO_DIR)")
    return missing


def _offered_key(websocket: WebSocket) -> str | None:
    for protocol in websocket.scope.get("subprotocols") or []:
        if isinstance(protocol, str) and protocol.startswith(KEY_SUBPROTOCOL):
            return protocol[len(KEY_SUBPROTOCOL) :]
    return None


def key_refusal(websocket: WebSocket, settings: Settings) -> JSONResponse | None:
    """The 401 that refuses the upgrade without a valid API key, or None."""
    keys = ApiKeys(settings.api_keys())
    if keys.enabled:
        headers = websocket.headers
        failure = keys.check(
            headers.get("authorization"), headers.get("x-api-key") or _offered_key(websocket)
        )
        if failure is not None:
            message = "Missing API key" if failure == "missing_api_key" else "Invalid API Key"
            return JSONResponse(error_body(message, failure), status_code=401)
    return None


def _refusal(websocket: WebSocket, state: ServerState) -> JSONResponse | None:
    """The HTTP answer that refuses the upgrade, or None to accept it."""
    refused = key_refusal(websocket, state.settings)
    if refused is not None:
        return refused
    missing = missing_models(state)
    if missing:
        uses = (["chat"] if state.client is not None else []) + served_uses(state.settings)
        message = (
            "/v1/realtime needs a chat model, a speech-to-text model and a text-to-speech"
            f" model; this server has no {', and no '.join(missing)}"
            f" (it serves {', '.join(uses) or 'no model routes'})"
        )
        return JSONResponse(error_body(message, "not_implemented"), status_code=501)
    if state.loading or state.client is None or state.audio is None or not state.audio.ready:
        return JSONResponse(
            error_body(MODEL_LOADING, "server_busy"), status_code=503, headers={"Retry-After": "5"}
        )
    return None


class Sessions:
    """The open sessions of one app (its event loop only)."""

    def __init__(self) -> None:
        self.open = 0

    def full(self, settings: Settings) -> bool:
        """Whether another session would be past `--realtime-max-sessions`."""
        return self.open >= settings.realtime_max_sessions


async def _accept(websocket: WebSocket) -> None:
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)


async def refuse_full(websocket: WebSocket, settings: Settings) -> None:
    """Accept the upgrade and close it at once with 1013 (too many sessions)."""
    await _accept(websocket)
    await websocket.close(
        code=TRY_AGAIN_LATER,
        reason=f"too many realtime sessions (at most {settings.realtime_max_sessions})",
    )


def _sessions(websocket: WebSocket) -> Sessions:
    app_state = websocket.app.state
    sessions = getattr(app_state, "realtime_sessions", None)
    if sessions is None:
        sessions = app_state.realtime_sessions = Sessions()
    return sessions


async def deny(websocket: WebSocket, refusal: JSONResponse) -> None:
    """Refuse the upgrade with `refusal` (an HTTP answer)."""
    try:
        await websocket.send_denial_response(refusal)
    except RuntimeError:  # a server without the denial extension: a bare refusal
        await websocket.close(code=1008)


@router.websocket("/v1/realtime")
@router.websocket("/realtime")
async def realtime(websocket: WebSocket) -> None:
    """One Realtime session (see the module doc)."""
    state: ServerState = websocket.app.state.mlxcel
    refusal = _refusal(websocket, state)
    if refusal is not None:
        await deny(websocket, refusal)
        return
    assert state.audio is not None
    await run_session(websocket, state, state.audio, state.audio, _sessions(websocket))


async def run_session(
    websocket: WebSocket,
    state: ServerState,
    stt: AudioWorker,
    tts: AudioWorker,
    sessions: Sessions,
    settings: Settings | None = None,
) -> None:
    """Accept the upgrade and serve one session: `state`'s chat model answers, `stt`
    transcribes and `tts` speaks; `settings` (by default `state`'s) set its limits."""
    settings = settings or state.settings
    if sessions.full(settings):
        await refuse_full(websocket, settings)
        return
    sessions.open += 1  # before the accept's wait: a session arriving meanwhile sees it
    try:
        await _accept(websocket)
        await _serve(websocket, state, stt, tts, settings)
    finally:
        sessions.open -= 1


async def _serve(
    websocket: WebSocket,
    state: ServerState,
    stt: AudioWorker,
    tts: AudioWorker,
    settings: Settings,
) -> None:
    lock = asyncio.Lock()
    gone = False

    async def send(message: dict[str, Any]) -> None:
        nonlocal gone
        if gone:
            return
        async with lock:
            try:
                await websocket.send_text(json.dumps(message, ensure_ascii=False))
            except (WebSocketDisconnect, RuntimeError, OSError):
                gone = True

    model = websocket.query_params.get("model") or (
        state.model_info.name if state.model_info else "mlxcel"
    )
    session = RealtimeSession(
        state,
        websocket,
        stt,
        send,
        model=model[:256],
        max_audio_seconds=settings.realtime_max_audio_seconds,
        speaker=tts,
    )
    idle = settings.realtime_idle_timeout or None
    try:
        await session.start()
        while not gone:
            try:
                message = await asyncio.wait_for(websocket.receive(), idle)
            except asyncio.TimeoutError:
                if session.busy:
                    continue
                await send(
                    error_event(
                        ClientEventError(
                            f"the session was idle for {idle:g} seconds", code="idle_timeout"
                        )
                    )
                )
                await websocket.close(code=1000, reason="idle timeout")
                return
            if message["type"] == "websocket.disconnect":
                return
            await _dispatch(session, message, send)
    except WebSocketDisconnect:
        return
    finally:
        gone = True
        await session.close()
        if (
            websocket.application_state == WebSocketState.CONNECTED
            and websocket.client_state == WebSocketState.CONNECTED
        ):
            with contextlib.suppress(RuntimeError, OSError):
                await websocket.close(code=1000)


async def _dispatch(session: RealtimeSession, message: Mapping[str, Any], send: Send) -> None:
    """One received frame: a JSON event handed to the session, or an `error` event."""
    text = message.get("text")
    if text is None:
        await send(
            error_event(
                ClientEventError(
                    "binary frames are not supported: send JSON events as text frames",
                    code="invalid_event",
                )
            )
        )
        return
    if len(text) > MAX_EVENT_CHARS:
        await send(error_event(ClientEventError("the event is too large", code="invalid_event")))
        return
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        await send(
            error_event(ClientEventError("the event is not valid JSON", code="invalid_json"))
        )
        return
    if not isinstance(body, dict):
        await send(
            error_event(ClientEventError("an event must be a JSON object", code="invalid_event"))
        )
        return
    await session.handle(body)
