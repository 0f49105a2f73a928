"""Routes of OpenAI's audio API, each also without the /v1 prefix:

- POST /v1/audio/transcriptions and /v1/audio/translations: multipart form with `file`
  (at most 25 MiB, else 413), `model`, `language`, `prompt`, `response_format`
  (json, text, srt, verbose_json, vtt), `temperature`, `timestamp_granularities[]`;
- POST /v1/audio/speech: JSON `model`, `input`, `voice`, `response_format` (wav, pcm), `speed`.

`audio_only_router(worker)` answers the chat and completion routes with 501 on a server that
runs audio models only.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response
from starlette.types import Message, Receive

from mlxcel.server.audio.protocol import (
    MAX_BODY_BYTES,
    MAX_UPLOAD_BYTES,
    SpeechRequest,
    TranscriptionForm,
)
from mlxcel.server.audio.serving import (
    require_worker,
    served_routes,
    speech_response,
    transcription_response,
)
from mlxcel.server.errors import APIError, bad_request, not_implemented
from mlxcel.server.json_body import JsonBodyRoute

if TYPE_CHECKING:
    from mlxcel.engine.workers.audio import AudioWorker

router = APIRouter(route_class=JsonBodyRoute)

UPLOAD_PATHS = (
    "/v1/audio/transcriptions",
    "/audio/transcriptions",
    "/v1/audio/translations",
    "/audio/translations",
)
"""Routes that take audio uploads: the app's body cap must allow `MAX_BODY_BYTES` on them."""

CHAT_AND_COMPLETION_ROUTES = (
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completions",
    "/completion",
    "/v1/responses",
    "/responses",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/v1/responses/compact",
    "/responses/compact",
    "/v1/messages",
    "/messages",
    "/v1/messages/count_tokens",
    "/messages/count_tokens",
    "/infill",
)
_MIB = 1024 * 1024


def _too_large(what: str) -> APIError:
    return APIError(
        413,
        f"{what} is too large: audio uploads are limited to {MAX_UPLOAD_BYTES // _MIB} MiB",
        "invalid_request_error",
    )


def _capped(receive: Receive, limit: int) -> Receive:
    """`receive` that raises 413 once more than `limit` body bytes have arrived."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _too_large("the request body")
        return message

    return capped


async def _read_form(request: Request) -> Any:
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("expected a multipart/form-data body with an audio `file` field")
    if importlib.util.find_spec("python_multipart") is None:
        raise APIError(
            501,
            "audio uploads need the python-multipart package on the server",
            "not_supported_error",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large("the request body")
    capped = Request(request.scope, receive=_capped(request.receive, MAX_BODY_BYTES))
    return await capped.form(max_files=1, max_fields=64, max_part_size=_MIB)


async def _upload(form: Any) -> tuple[bytes, str]:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request("missing the audio `file` field (multipart/form-data)")
    if upload.size is not None and upload.size > MAX_UPLOAD_BYTES:
        raise _too_large(f"file {upload.filename or 'audio'!r}")
    data = await upload.read()
    if len(data) > MAX_UPLOAD_BYTES:
        raise _too_large(f"file {upload.filename or 'audio'!r}")
    return data, upload.filename or "audio"


async def _transcription(request: Request, task: str) -> Response:
    worker = require_worker(request, stt=True)
    form = await _read_form(request)
    try:
        fields = TranscriptionForm.parse(form, translation=task == "translate")
        data, filename = await _upload(form)
    finally:
        await form.close()
    return await transcription_response(worker, data, filename, fields, task=task)


@router.post("/v1/audio/transcriptions")
@router.post("/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    """Speech to text in the spoken language."""
    return await _transcription(request, "transcribe")


@router.post("/v1/audio/translations")
@router.post("/audio/translations")
async def create_translation(request: Request) -> Response:
    """Speech to English text."""
    return await _transcription(request, "translate")


@router.post("/v1/audio/speech")
@router.post("/audio/speech")
async def create_speech(request: Request, body: SpeechRequest) -> Response:
    """Text to speech: a 24 kHz mono WAV (or raw 16-bit PCM)."""
    worker = require_worker(request, stt=False)
    return await speech_response(worker, body)


def audio_only_router(worker: AudioWorker | None) -> APIRouter:
    """Chat and completion routes answering 501 `not_implemented`, naming what is served."""
    served = served_routes(worker)
    listing = ", ".join(f"POST {route}" for route in served) or "no model routes"
    message = f"this server runs audio models only; it serves {listing}"
    stub = APIRouter()

    async def unavailable() -> Response:
        raise not_implemented(message)

    for path in CHAT_AND_COMPLETION_ROUTES:
        stub.add_api_route(path, unavailable, methods=["POST"], include_in_schema=False)
    return stub
