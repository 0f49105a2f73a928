"""Media decoding never runs on the event loop (issue 34.5b).

A 7000x7000 1-bit PNG is 8 KB on the wire and 49 M pixels decoded; four of them used to hold
`/health` off for seconds. Every step that costs time on a large input (base64, file reads,
picture decoding, video frames, WAV and audio-upload decoding, the vision processor, the
image-edit checks) runs on the media pool (`mlxcel.server.media.offload`); data URIs and
pictures in its worker processes by default, on its threads with `MLXCEL_MEDIA_PROCESSES=0`
(the thread tests here wrap the decoders in this process, so they turn the processes off).

The proof is not a timing: the decoder is wrapped so that it waits on a gate the test holds
closed; `/health` must answer while those decodes are still in progress (a decode on the loop
would keep the loop from ever reading the `/health` request), and each step records the
thread it ran on.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import threading
import wave
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mlxcel.config.process_env import MEDIA_PROCESSES
from mlxcel.engine.media.errors import MediaError
from mlxcel.server.media import MediaPolicy, offload, parts, sources
from mlxcel.server.media.parts import ModelMedia, collect_media

CLIENTS = 4


def _png_uri(size: tuple[int, int], mode: str = "1") -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, size, 1).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _wav_b64() -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(16000)
        writer.writeframes(np.zeros(1600, dtype="<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()


class Threads:
    """Records the thread each wrapped call ran on."""

    def __init__(self) -> None:
        self.names: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.names.setdefault(label, []).append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return recorded

    def assert_off_loop(self, *labels: str) -> None:
        for label in labels:
            names = self.names.get(label)
            assert names, f"{label} was never called"
            assert all(n.startswith(offload.THREAD_PREFIX) for n in names), (label, names)


def test_every_collect_step_runs_on_the_media_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Data URIs, local files, pictures, video frames and WAV clips of one chat message."""
    monkeypatch.setenv(MEDIA_PROCESSES, "0")
    threads = Threads()
    for module, name in (
        (sources, "parse_data_uri"),
        (sources, "read_local_file"),
        (parts, "decode_image"),
        (sources, "decode_image"),
        (parts, "sample_frames"),
        (parts, "decode_wav"),
    ):
        monkeypatch.setattr(module, name, threads.wrap(name, getattr(module, name)))
    (tmp_path / "local.png").write_bytes(base64.b64decode(_png_uri((8, 8), "RGB").split(",")[1]))
    video = {"url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}
    content = [
        {"type": "image_url", "image_url": {"url": _png_uri((64, 64))}},
        {"type": "image_url", "image_url": {"url": str(tmp_path / "local.png")}},
        {"type": "input_audio", "input_audio": {"data": _wav_b64(), "format": "wav"}},
    ]
    model = ModelMedia(frozenset({"text", "image", "audio", "video"}), video_with_audio=True)
    policy = MediaPolicy(media_root=tmp_path)
    _, inputs = asyncio.run(collect_media([{"role": "user", "content": content}], policy, model))
    assert len(inputs.images) == 2 and len(inputs.audio) == 1
    with pytest.raises(parts.MediaError, match="unsupported video container"):
        video_part = [{"type": "video_url", "video_url": video}]
        asyncio.run(collect_media([{"role": "user", "content": video_part}], policy, model))
    threads.assert_off_loop(
        "parse_data_uri", "read_local_file", "decode_image", "sample_frames", "decode_wav"
    )


def test_data_uris_and_pictures_decode_in_worker_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By default a data URI's base64 and its picture are decoded in another process (not
    on the media threads, whose GIL the event loop shares): the same picture as on the
    threads, and a refusal there is the same MediaError here."""
    monkeypatch.delenv(MEDIA_PROCESSES, raising=False)
    on_threads: list[str] = []
    thread_pool = offload.off_loop

    async def recorded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        on_threads.append(getattr(fn, "__name__", repr(fn)))
        return await thread_pool(fn, *args, **kwargs)

    for module in (offload, sources, parts):
        monkeypatch.setattr(module, "off_loop", recorded)
    assert asyncio.run(offload.off_process(os.getpid)) != os.getpid()
    # noise over 400x300: its data URI is longer than one staged piece (256 KiB)
    pixels = np.random.default_rng(3).integers(0, 255, (300, 400, 3), dtype=np.uint8)
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}
    model = ModelMedia(frozenset({"text", "image"}))
    _, inputs = asyncio.run(collect_media([message], MediaPolicy(), model))
    decoders = {"parse_data_uri", "decode_image", "decode_image_uri"}
    assert not decoders & set(on_threads)  # no decoding step ran on the threads
    assert np.array_equal(np.asarray(inputs.images[0]), pixels)
    bad = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri[:-9]}}]}
    with pytest.raises(MediaError, match="not valid base64|corrupt or truncated"):
        asyncio.run(collect_media([bad], MediaPolicy(), model))
    assert not decoders & set(on_threads)


def test_where_worker_processes_cannot_start_the_threads_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A system where processes cannot start (no semaphores, a process limit): the media
    threads do the work, from then on, instead of failing every picture."""

    class Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise OSError(38, "Function not implemented")

    monkeypatch.delenv(MEDIA_PROCESSES, raising=False)
    monkeypatch.setattr(offload, "_processes", None)
    monkeypatch.setattr(offload, "_processes_failed", False)
    monkeypatch.setattr(offload, "ProcessPoolExecutor", Unavailable)
    names = [asyncio.run(offload.off_process(threading.current_thread)).name for _ in range(2)]
    assert all(name.startswith(offload.THREAD_PREFIX) for name in names)
    assert offload._processes_failed


def test_a_worker_process_that_dies_fails_its_input_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An input that kills its decoding process is a MediaError (a 400) for that request;
    the server process lives on and the next input gets a new worker."""
    monkeypatch.delenv(MEDIA_PROCESSES, raising=False)
    with pytest.raises(MediaError, match="media worker process stopped"):
        asyncio.run(offload.off_process(os._exit, 3))
    assert asyncio.run(offload.off_process(os.getpid)) != os.getpid()


# ------------------------------------------------------------------ a served vision model


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    from fixtures.tiny_vlm import build_tiny_qwen2_vl
    from server_harness import InProcessServer

    from mlxcel.config.settings import Settings

    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))
    settings = Settings(model=str(model), ctx_size=2048, warmup=False)
    with InProcessServer(settings) as server:
        yield server


class Gate:
    """Wraps the picture decoder: each call counts itself in, waits for the gate, decodes."""

    def __init__(self, decode: Callable[..., Any]) -> None:
        self.decode = decode
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)
        self.in_progress = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.in_progress += 1
        self.entered.release()
        try:
            self.opened.wait(15)  # bounded: a decode stuck on the loop fails, never hangs
            return self.decode(*args, **kwargs)
        finally:
            with self._lock:
                self.in_progress -= 1


def test_health_answers_while_big_pictures_are_decoding(
    vision_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MEDIA_PROCESSES, "0")  # the gate is a decoder in this process
    gate = Gate(parts.decode_image)
    monkeypatch.setattr(parts, "decode_image", gate)
    monkeypatch.setattr(sources, "decode_image", gate)  # a data URI's picture
    threads = Threads()
    import mlx_vlm  # the vision processor (resize, patches), which the engine calls lazily

    monkeypatch.setattr(
        mlx_vlm, "prepare_inputs", threads.wrap("processor", mlx_vlm.prepare_inputs)
    )
    uri = _png_uri((3000, 3000))  # 9 M pixels, a few KB on the wire
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": uri}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}

    def chat() -> int:
        with httpx.Client(base_url=vision_server.url, timeout=120) as client:
            return client.post("/v1/chat/completions", json=body).status_code

    with ThreadPoolExecutor(CLIENTS) as clients:
        answers = [clients.submit(chat) for _ in range(CLIENTS)]
        try:
            assert gate.entered.acquire(timeout=60), "no decode started"
            with httpx.Client(base_url=vision_server.url, timeout=60) as client:
                health = client.get("/health")
            running = gate.in_progress
        finally:
            gate.opened.set()
        codes = [answer.result() for answer in answers]
    assert health.status_code == 200
    assert running >= 1, "/health was answered only once no decode was running"
    assert codes == [200] * CLIENTS
    threads.assert_off_loop("processor")


# ------------------------------------------------------------------ audio uploads and edits


def test_audio_uploads_decode_on_the_media_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from fixtures.audio import stub_audio_client

    from mlxcel.engine.audio import codec

    threads = Threads()

    def refuse(data: bytes, **_: Any) -> Any:
        raise codec.AudioDecodeError("stub: refused after recording the thread")

    monkeypatch.setattr(codec, "read_audio", threads.wrap("read_audio", refuse))
    with stub_audio_client() as client:
        files = {"file": ("a.wav", base64.b64decode(_wav_b64()), "audio/wav")}
        answer = client.post("/v1/audio/transcriptions", files=files, data={"model": "w"})
    assert answer.status_code == 400 and "stub" in answer.json()["error"]["message"]
    threads.assert_off_loop("read_audio")


def test_image_edit_inputs_decode_on_the_media_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from mlxcel.config.settings import Settings
    from mlxcel.server.errors import bad_request, install_error_handlers
    from mlxcel.server.images import routes
    from mlxcel.server.state import ServerState

    threads = Threads()

    def refuse(body: Any) -> Any:
        raise bad_request("stub: refused after recording the thread")

    monkeypatch.setattr(routes, "edit_inputs", threads.wrap("edit_inputs", refuse))
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(routes.router)
    # a worker is required before the inputs are read
    app.state.mlxcel = ServerState(settings=Settings(warmup=False), image=object())
    with TestClient(app) as client:
        answer = client.post("/v1/images/edits", json={"prompt": "x", "image": _png_uri((64, 64))})
    assert answer.status_code == 400 and "stub" in answer.json()["error"]["message"]
    threads.assert_off_loop("edit_inputs")


_KILLED_SERVER = """
import asyncio, os, sys, time
from mlxcel.server.media import offload
pid = asyncio.run(offload.off_process(os.getpid))
print(pid, flush=True)
time.sleep(60)
"""


def test_a_killed_servers_worker_processes_leave(tmp_path: Path) -> None:
    """A server killed outright (SIGKILL: no exit handlers) leaves no media worker behind:
    each worker sees its server gone within a few seconds and exits."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ}
    env.pop(MEDIA_PROCESSES, None)
    server = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SERVER], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert server.stdout is not None
        worker = int(server.stdout.readline())
        assert worker != server.pid and os.path.exists(f"/proc/{worker}") or sys.platform != "linux"
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(10)
    deadline = time.monotonic() + 4 * offload.PARENT_CHECK_S + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _alive(worker)
    if left:  # never leave it running
        os.kill(worker, signal.SIGKILL)
    assert not left


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie reaped by init counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


_STDIN_SERVER = """
import asyncio, base64, io
from PIL import Image
from mlxcel.server.media.sources import decode_data_image
out = io.BytesIO()
Image.new("RGB", (40, 30), (9, 99, 199)).save(out, format="PNG")
uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
for _ in range(2):
    picture = asyncio.run(decode_data_image(uri, 1 << 20, 1 << 20))
    print(picture.size, picture.getpixel((0, 0)), flush=True)
"""


def test_where_a_worker_cannot_start_pictures_still_decode() -> None:
    """A program read from stdin cannot be imported by a spawned worker, so every worker
    dies as it starts: the pool's first job (a no-op) tells, and pictures decode on the
    threads from then on, with a warning, rather than each failing."""
    import subprocess
    import sys

    env = {**os.environ}
    env.pop(MEDIA_PROCESSES, None)
    run = subprocess.run(
        [sys.executable, "-"], input=_STDIN_SERVER, capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["(40, 30) (9, 99, 199)"] * 2
    assert "media worker processes cannot start" in run.stderr
