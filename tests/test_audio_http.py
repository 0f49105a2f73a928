"""OpenAI audio routes through the official openai SDK and httpx, against an in-process app
built from the audio router (tiny random Whisper and Kokoro models on a real audio worker)."""

from __future__ import annotations

import asyncio
import io
import threading
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from fixtures.audio import speech_wav, tiny_kokoro_dir, tiny_whisper_dir
from fixtures.server_state import serve_side_models

from mlxcel.engine.audio.codec import read_audio
from mlxcel.engine.audio.transcribe import TranscriptionOptions, transcribe
from mlxcel.engine.workers.audio import AudioModels, AudioWorker
from mlxcel.server.audio import audio_only_router, router
from mlxcel.server.audio.protocol import MAX_UPLOAD_BYTES
from mlxcel.server.errors import install_error_handlers

TRANSCRIPTION_PATHS = ["/v1/audio/transcriptions", "/audio/transcriptions"]


def make_app(worker: AudioWorker | None, *, audio_only: bool = False) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    if audio_only:
        app.include_router(audio_only_router(worker))
    serve_side_models(app, audio=worker)
    return app


@pytest.fixture(scope="module")
def worker() -> Iterator[AudioWorker]:
    audio = AudioWorker(
        stt_model=str(tiny_whisper_dir()), tts_model=str(tiny_kokoro_dir()), queue_depth=2
    ).start()
    yield audio
    audio.stop()


@pytest.fixture(scope="module")
def client(worker: AudioWorker) -> Iterator[TestClient]:
    with TestClient(make_app(worker)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def sdk(client: TestClient) -> Any:
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


@pytest.fixture(scope="module")
def wav() -> bytes:
    return speech_wav().read_bytes()


@pytest.fixture(scope="module")
def expected(worker: AudioWorker, wav: bytes) -> Any:
    """What the engine itself makes of the recording, with the worker's model."""
    assert worker.models.stt is not None
    return transcribe(worker.models.stt, read_audio(wav).samples, TranscriptionOptions())


def post_form(client: TestClient, path: str, data: bytes, **fields: Any) -> Any:
    return client.post(path, files={"file": ("speech.wav", data, "audio/wav")}, data=fields)


# --------------------------------------------------------------------------- speech to text


def test_sdk_transcription_matches_the_engine(sdk: Any, wav: bytes, expected: Any) -> None:
    result = sdk.audio.transcriptions.create(model="whisper-1", file=("speech.wav", wav))
    assert result.text == expected.text


def test_sdk_response_formats(sdk: Any, wav: bytes, expected: Any) -> None:
    text = sdk.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", wav), response_format="text"
    )
    assert text.strip() == expected.text
    srt = sdk.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", wav), response_format="srt"
    )
    vtt = sdk.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", wav), response_format="vtt"
    )
    spoken = [s for s in expected.segments if s.text.strip()]
    assert srt.count(" --> ") == len(spoken) and (not spoken or srt.startswith("1\n00:"))
    assert vtt.startswith("WEBVTT\n") and vtt.count(" --> ") == len(spoken)


def test_sdk_verbose_json_with_words_and_segments(sdk: Any, wav: bytes, expected: Any) -> None:
    result = sdk.audio.transcriptions.create(
        model="whisper-1",
        file=("speech.wav", wav),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert result.duration == pytest.approx(expected.duration)
    assert result.language == "english"
    assert len(result.segments) == len(expected.segments)
    assert result.words, "word timestamps were asked for"
    for word in result.words:
        assert 0.0 <= word.start <= word.end <= result.duration
    plain = sdk.audio.transcriptions.create(
        model="whisper-1", file=("speech.wav", wav), response_format="verbose_json"
    )
    assert not getattr(plain, "words", None) and plain.segments


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_sdk_translation(sdk: Any, wav: bytes, expected: Any) -> None:
    result = sdk.audio.translations.create(model="whisper-1", file=("speech.wav", wav))
    assert result.text == expected.text  # an English-only model writes English either way


def test_alias_without_v1(client: TestClient, wav: bytes, expected: Any) -> None:
    response = post_form(client, "/audio/translations", wav, response_format="json")
    assert response.status_code == 200 and response.json() == {"text": expected.text}


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"response_format": "mp3"}, "supported: json, text, srt, verbose_json, vtt"),
        ({"timestamp_granularities[]": "word"}, "requires response_format=verbose_json"),
        ({"temperature": "2"}, "between 0 and 1"),
        ({"language": "fr"}, "English-only"),
        ({"stream": "true"}, "streaming"),
    ],
)
def test_bad_transcription_fields(
    client: TestClient, wav: bytes, fields: dict, needle: str
) -> None:
    response = post_form(client, "/v1/audio/transcriptions", wav, **fields)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def test_bad_uploads(client: TestClient) -> None:
    missing = client.post(
        "/v1/audio/transcriptions", data={"model": "whisper-1"}, files={"x": b"1"}
    )
    assert missing.status_code == 400 and "`file`" in missing.json()["error"]["message"]
    as_json = client.post("/v1/audio/transcriptions", json={"file": "x"})
    assert as_json.status_code == 400 and "multipart" in as_json.json()["error"]["message"]
    not_audio = post_form(client, "/v1/audio/transcriptions", b"ID3" + b"\x00" * 32)
    message = not_audio.json()["error"]["message"]
    # one clear line whether ffmpeg is on PATH (it cannot decode the bytes) or not (install it)
    assert not_audio.status_code == 400 and ("ffmpeg" in message or "cannot decode" in message)


def test_uploads_over_25_mib_get_413(client: TestClient) -> None:
    big = b"RIFF" + b"\x00" * (MAX_UPLOAD_BYTES + 1)
    response = post_form(client, "/v1/audio/transcriptions", big)
    assert response.status_code == 413
    assert "25 MiB" in response.json()["error"]["message"]


# --------------------------------------------------------------------------- text to speech


def test_sdk_speech_is_a_24khz_wav(sdk: Any) -> None:
    response = sdk.audio.speech.create(
        model="kokoro", voice="fable", input="[[hˈI]]", response_format="wav"
    )
    with wave.open(io.BytesIO(response.content)) as audio:
        assert audio.getframerate() == 24_000
        assert audio.getnchannels() == 1 and audio.getsampwidth() == 2
        frames = audio.getnframes()
        samples = np.frombuffer(audio.readframes(frames), dtype="<i2")
    assert frames > 0 and np.abs(samples).max() > 0
    assert response.response.headers["x-voice"] == "bm_fable"


@pytest.fixture(scope="module")
def default_speech(sdk: Any) -> Any:
    """The SDK's speech call without response_format, with an OpenAI voice name."""
    return sdk.audio.speech.create(model="kokoro", voice="alloy", input="[[hˈI]]")


def test_speech_defaults_to_wav(default_speech: Any) -> None:
    assert default_speech.content[:4] == b"RIFF" and default_speech.content[8:12] == b"WAVE"
    assert default_speech.response.headers["content-type"] == "audio/wav"
    assert default_speech.response.headers["x-voice"] == "af_heart"  # no af_alloy pack


def test_speech_pcm_and_unsupported_formats(client: TestClient, default_speech: Any) -> None:
    body = {"model": "kokoro", "input": "[[hˈI]]", "voice": "af_heart"}
    pcm = client.post("/audio/speech", json={**body, "response_format": "pcm"})
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    assert pcm.content == default_speech.content[44:]  # the same samples, no 44-byte header
    mp3 = client.post("/v1/audio/speech", json={**body, "response_format": "mp3"})
    assert mp3.status_code == 400
    assert "supported: wav, pcm" in mp3.json()["error"]["message"]
    for bad, needle in [
        ({"voice": "nobody"}, "available: af_heart, bm_fable"),
        ({"speed": 5}, "speed"),
    ]:
        response = client.post("/v1/audio/speech", json={**body, **bad})
        assert response.status_code == 400 and needle in response.json()["error"]["message"]
    missing = client.post("/v1/audio/speech", json={"model": "kokoro"})
    assert missing.status_code == 400


# --------------------------------------------------------------------------- serving model


def test_routes_answer_501_without_models(wav: bytes) -> None:
    with TestClient(make_app(None)) as bare:
        response = post_form(bare, "/v1/audio/transcriptions", wav)
        assert response.status_code == 501
        assert response.json()["error"]["type"] == "not_implemented"
        assert "--audio-model" in response.json()["error"]["message"]
        speech = bare.post("/v1/audio/speech", json={"model": "k", "input": "hi", "voice": "a"})
        assert speech.status_code == 501 and "--tts-model" in speech.json()["error"]["message"]


def test_audio_only_server_answers_chat_with_501(worker: AudioWorker) -> None:
    with TestClient(make_app(worker, audio_only=True)) as audio_only:
        for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
            response = audio_only.post(path, json={"messages": []})
            assert response.status_code == 501, path
            error = response.json()["error"]
            assert error["type"] == "not_implemented"
            assert "POST /v1/audio/transcriptions" in error["message"]
            assert "POST /v1/audio/speech" in error["message"]


def _stub_worker(**kwargs: Any) -> tuple[AudioWorker, threading.Event]:
    """A worker whose 'model' is a stub: jobs block until released."""
    release = threading.Event()
    audio = AudioWorker(loader=lambda: AudioModels(stt=object()), **kwargs).start()  # type: ignore[arg-type]

    def blocked(_samples: Any, _options: Any) -> Any:
        return audio.submit(lambda _m, stop: release.wait(30) and stop())

    audio.transcribe = blocked  # type: ignore[method-assign]
    return audio, release


def test_full_queue_is_503_and_timeout_is_504(wav: bytes) -> None:
    busy, release = _stub_worker(queue_depth=1, timeout=None)
    started = threading.Event()
    busy.submit(lambda _m, _s: started.set() or release.wait(30))
    assert started.wait(10)
    busy.submit(lambda _m, _s: None)  # fills the queue
    try:
        with TestClient(make_app(busy)) as app:
            response = post_form(app, "/v1/audio/transcriptions", wav)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "server_busy"
    finally:
        release.set()
        busy.stop()
    slow, release = _stub_worker(timeout=0.3)
    try:
        with TestClient(make_app(slow)) as app:
            response = post_form(app, "/v1/audio/transcriptions", wav)
            assert response.status_code == 504
            assert response.json()["error"]["type"] == "timeout_error"
            assert "0.3 s" in response.json()["error"]["message"]
    finally:
        release.set()
        slow.stop()


def test_http_handlers_never_block_on_the_worker(
    worker: AudioWorker, wav: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a job runs on the worker thread the event loop keeps serving.

    The transcription first waits, on the worker thread, for a gate that only the event
    loop's ticker opens: the request can finish only if the loop ran while it waited.
    """
    import httpx

    gate = threading.Event()
    original = worker.transcribe

    def gated(samples: Any, options: Any) -> Any:
        worker.submit(lambda _m, _stop: gate.wait(10))  # the worker runs one job at a time
        return original(samples, options)

    monkeypatch.setattr(worker, "transcribe", gated)
    app = make_app(worker)
    finished: dict[str, float] = {}

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:

            async def request() -> int:
                files = {"file": ("a.wav", wav, "audio/wav")}
                response = await http.post("/v1/audio/transcriptions", files=files)
                finished["request"] = loop.time()
                return response.status_code

            async def ticker() -> None:
                for _ in range(5):
                    await asyncio.sleep(0.01)
                finished["ticker"] = loop.time()
                gate.set()

            status, _ = await asyncio.gather(request(), ticker())
            return status

    assert asyncio.run(scenario()) == 200
    assert finished["ticker"] < finished["request"]
