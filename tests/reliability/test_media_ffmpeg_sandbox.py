"""ffmpeg reads only the bytes a client sent, never a file or URL those bytes name (issue 34.1).

An HLS playlist or DASH manifest sent as a "video" (data URI or fetched URL) or as an audio
upload names a local canary or a loopback listener; so do `concat:`, `subfile,` and ffconcat
tricks and a polyglot (an mp4 header followed by playlist text). Every one must answer 400
with neither an open of the canary nor a hit on the listener. The canary is a FIFO whose
writer counts each open (a read needs an open; no reliance on access times), so it also
catches an ffmpeg that opens the file and fails at once. Real small clips still decode.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")

from fixtures.tiny_vlm import build_tiny_qwen2_vl  # noqa: E402
from server_harness import API_KEY, AUTH, ServeProcess  # noqa: E402

ENV = {
    "HF_HUB_OFFLINE": "1",
    "MLX_DISABLE_COMPILE": "1",
    "TQDM_DISABLE": "1",
    "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS": "1",  # so a loopback URL reaches the decoder at all
}
MP4_HEADER = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"


@pytest.fixture(scope="module", autouse=True)
def _needs_ffmpeg() -> None:
    if shutil.which("ffmpeg") is None:
        pytest.fail("ffmpeg is needed for the media sandbox tests (.ci/run installs it)")


class Canary:
    """A FIFO outside every media root; a writer thread counts each time something opens it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.opens = 0
        self._closing = False
        os.mkfifo(path, 0o644)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            fd = os.open(self.path, os.O_WRONLY)  # blocks until a reader opens the FIFO
            os.close(fd)  # the reader sees end of file at once
            if self._closing:
                return
            self.opens += 1

    def close(self) -> None:
        self._closing = True
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # releases the blocked writer
        self._thread.join(5)
        os.close(fd)


class Listener:
    """A loopback HTTP server: serves the hostile payloads under /media/, counts other hits."""

    def __init__(self) -> None:
        self.media: dict[str, bytes] = {}
        self.hits: list[str] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                name = self.path.removeprefix("/media/")
                body = listener.media.get(name) if self.path.startswith("/media/") else None
                if body is None:
                    listener.hits.append(self.path)
                    body = b"\x47" * 188
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _hls(target: str) -> bytes:
    return f"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\n{target}\n#EXT-X-ENDLIST\n".encode()


def _mpd(target: str) -> bytes:
    return (
        '<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011" type="static" '
        'mediaPresentationDuration="PT1S" minBufferTime="PT1S" '
        'profiles="urn:mpeg:dash:profile:isoff-on-demand:2011"><Period>'
        '<AdaptationSet mimeType="video/mp2t"><Representation id="1" bandwidth="1000">'
        f"<BaseURL>{target}</BaseURL></Representation></AdaptationSet></Period></MPD>"
    ).encode()


def hostile_payloads(canary: Path, listener: str) -> dict[str, bytes]:
    """Playlists, manifests and tricks that name the canary or the listener."""
    segment = f"{listener}/segment.ts"
    return {
        "hls-file-url": _hls(f"file://{canary}"),
        "hls-path": _hls(str(canary)),
        "hls-http": _hls(segment),
        "hls-concat": _hls(f"concat:{canary}|{canary}"),
        "hls-subfile": _hls(f"subfile,,start,0,end,0,,:{canary}"),
        "dash-file-url": _mpd(f"file://{canary}"),
        "dash-path": _mpd(str(canary)),
        "dash-http": _mpd(segment),
        "ffconcat": f"ffconcat version 1.0\nfile '{canary}'\nfile '{segment}'\n".encode(),
        "mp4-polyglot": MP4_HEADER + b"\n" + _hls(f"file://{canary}"),
        "id3-polyglot": b"ID3\x04\x00\x00\x00\x00\x00\x00\n" + _hls(f"file://{canary}"),
    }


NAMES = list(hostile_payloads(Path("/x"), "http://x"))


@pytest.fixture(scope="module")
def canary(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Canary]:
    fifo = Canary(tmp_path_factory.mktemp("outside") / "canary.ts")
    yield fifo
    fifo.close()


@pytest.fixture(scope="module")
def listener(canary: Canary) -> Iterator[Listener]:
    server = Listener()
    server.media = hostile_payloads(canary.path, server.url)
    yield server
    server.close()


@pytest.fixture(scope="module")
def payloads(listener: Listener) -> dict[str, bytes]:
    return listener.media


@pytest.fixture(autouse=True)
def _fresh_counts(canary: Canary, listener: Listener) -> None:
    """Each test counts only its own opens and hits."""
    canary.opens = 0
    listener.hits.clear()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))
    media = tmp_path_factory.mktemp("media")
    args = ["-m", str(model), "--api-key", API_KEY, "-c", "2048", "--media-path", str(media)]
    with ServeProcess(args, env=ENV) as proc:
        yield proc


@pytest.fixture(scope="module")
def audio_client() -> Iterator[Any]:
    """The audio routes in process: decoding happens before the (stub) worker."""
    from fixtures.audio import stub_audio_client

    with stub_audio_client() as client:
        yield client


def _video_body(url: str) -> dict[str, Any]:
    video = {"type": "video_url", "video_url": {"url": url}}
    content = [{"type": "text", "text": "Describe"}, video]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _assert_untouched(canary: Canary, listener: Listener) -> None:
    assert canary.opens == 0, "ffmpeg opened a file the request named"
    assert listener.hits == [], f"ffmpeg fetched {listener.hits}"


@pytest.mark.parametrize("name", NAMES)
def test_hostile_video_data_uri_is_refused_unread(
    name: str, server: ServeProcess, payloads: dict[str, bytes], canary: Canary, listener: Listener
) -> None:
    body = _video_body(_data_uri(payloads[name], "video/mp4"))
    with server.client(headers=AUTH, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    expected = "could not be decoded" if name == "mp4-polyglot" else "unsupported video container"
    assert expected in message
    _assert_untouched(canary, listener)


@pytest.mark.parametrize("name", ["hls-file-url", "dash-path", "mp4-polyglot"])
def test_hostile_video_url_is_refused_unread(
    name: str, server: ServeProcess, canary: Canary, listener: Listener
) -> None:
    body = _video_body(f"{listener.url}/media/{name}")
    with server.client(headers=AUTH, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    _assert_untouched(canary, listener)


@pytest.mark.parametrize("name", NAMES)
def test_hostile_audio_upload_is_refused_unread(
    name: str, audio_client: Any, payloads: dict[str, bytes], canary: Canary, listener: Listener
) -> None:
    files = {"file": (f"{name}.m3u8", payloads[name], "audio/mpeg")}
    answer = audio_client.post("/v1/audio/transcriptions", files=files, data={"model": "w"})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "unsupported audio container" in message or "cannot decode mp" in message
    _assert_untouched(canary, listener)


def _clip(tmp_path: Path, name: str, *extra: str) -> bytes:
    path = tmp_path / name
    source = ["-f", "lavfi", "-i", "testsrc=size=56x56:rate=4:duration=1"]
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", *source, *extra, str(path)], check=True)
    return path.read_bytes()


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("clip.mp4", ("-pix_fmt", "yuv420p")),
        ("clip.webm", ("-c:v", "libvpx", "-b:v", "100k")),
        ("clip.avi", ()),
        ("clip.ts", ()),
    ],
)
def test_real_clips_still_work(
    name: str, extra: tuple[str, ...], server: ServeProcess, tmp_path: Path
) -> None:
    body = _video_body(_data_uri(_clip(tmp_path, name, *extra), "video/mp4"))
    with server.client(headers=AUTH, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 10


@pytest.mark.parametrize("name", ["tone.mp3", "tone.ogg", "tone.m4a", "tone.aac", "tone.webm"])
def test_real_audio_still_decodes(name: str, tmp_path: Path) -> None:
    from mlxcel.engine.audio.codec import read_audio

    path = tmp_path / name
    source = ["-f", "lavfi", "-i", "sine=frequency=440:duration=1:sample_rate=16000"]
    subprocess.run(["ffmpeg", "-nostdin", "-v", "error", *source, str(path)], check=True)
    audio = read_audio(path.read_bytes(), name=name)
    assert 0.9 < audio.duration < 1.2 and float(abs(audio.samples).max()) > 0.1
