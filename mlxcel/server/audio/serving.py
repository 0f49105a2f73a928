"""Audio requests → worker jobs, and worker results → OpenAI's response bodies."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlxcel.server.audio.protocol import SPEECH_MEDIA_TYPES, SpeechRequest, TranscriptionForm
from mlxcel.server.bridge import await_engine
from mlxcel.server.errors import bad_request, model_loading, not_implemented
from mlxcel.server.media.offload import off_loop
from mlxcel.server.state import get_state

if TYPE_CHECKING:
    from mlxcel.engine.audio.transcribe import Transcription
    from mlxcel.engine.workers.audio import AudioWorker

TRANSCRIPTION_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
SPEECH_ROUTES = ("/v1/audio/speech",)


def audio_worker(request: Request) -> AudioWorker | None:
    """The server's audio worker (`ServerState.audio`; None: no audio model)."""
    return get_state(request).audio


def served_routes(worker: AudioWorker | None) -> list[str]:
    """The audio routes `worker` can answer (POST, with /v1)."""
    if worker is None:
        return []
    routes = list(TRANSCRIPTION_ROUTES) if worker.has_stt else []
    return routes + (list(SPEECH_ROUTES) if worker.has_tts else [])


def require_worker(request: Request, *, stt: bool) -> AudioWorker:
    """The worker for a speech-to-text (`stt`) or text-to-speech route; 501 or 503 if none."""
    worker = audio_worker(request)
    if worker is not None and not worker.ready and worker.running:
        raise model_loading()
    if stt and (worker is None or not worker.has_stt):
        raise not_implemented(
            "this server has no speech-to-text model; start it with --audio-model MODEL"
            " (--audio-model default: the shipped Whisper tiny.en)"
        )
    if not stt and (worker is None or not worker.has_tts):
        raise not_implemented(
            "this server has no text-to-speech model; start it with --tts-model KOKORO_DIR"
        )
    assert worker is not None
    return worker


async def transcription_response(
    worker: AudioWorker, data: bytes, filename: str, form: TranscriptionForm, *, task: str
) -> Response:
    """Decode the upload, transcribe (or translate) it on the worker, render the answer."""
    from mlxcel.engine.audio.codec import AudioDecodeError, read_audio
    from mlxcel.engine.audio.transcribe import TranscriptionOptions

    try:
        audio = await off_loop(read_audio, data, name=filename)
    except AudioDecodeError as exc:
        raise bad_request(str(exc)) from exc
    options = TranscriptionOptions(
        language=form.language,
        task="translate" if task == "translate" else "transcribe",
        prompt=form.prompt,
        temperature=form.temperature,
        word_timestamps=form.words,
    )
    result = await await_engine(lambda: worker.transcribe(audio.samples, options), worker.timeout)
    return render_transcription(result, form)


def render_transcription(result: Transcription, form: TranscriptionForm) -> Response:
    """The body for `form.response_format`."""
    from mlxcel.engine.audio.formats import MEDIA_TYPES, as_json, as_srt, as_verbose_json, as_vtt

    fmt = form.response_format
    if fmt == "json":
        return JSONResponse(as_json(result))
    if fmt == "verbose_json":
        body: Any = as_verbose_json(result, segments=form.segments, words=form.words)
        return Response(json.dumps(body, ensure_ascii=False), media_type=MEDIA_TYPES[fmt])
    if fmt == "text":
        return PlainTextResponse(result.text + "\n")
    text = as_srt(result) if fmt == "srt" else as_vtt(result)
    return Response(text, media_type=MEDIA_TYPES[fmt])


async def speech_response(worker: AudioWorker, body: SpeechRequest) -> Response:
    """Synthesize `body.input` on the worker; WAV (or raw PCM) at the model's rate."""
    from mlxcel.engine.audio.codec import to_pcm16, write_wav

    fmt = body.audio_format()
    if not body.input.strip():
        raise bad_request("input must not be empty")
    speech = await await_engine(
        lambda: worker.speak(body.input, voice=body.voice, speed=body.speed), worker.timeout
    )
    if fmt == "pcm":
        content = to_pcm16(speech.samples)
    else:
        content = write_wav(speech.samples, speech.sample_rate)
    headers = {"X-Sample-Rate": str(speech.sample_rate), "X-Voice": speech.voice}
    return Response(content, media_type=SPEECH_MEDIA_TYPES[fmt], headers=headers)
