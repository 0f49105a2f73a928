"""Per-request overhead of media inputs: fetching and decoding, before any model work.

Times `collect_media` (the one pass every API family's image/video/audio parts go through)
for a data-URI PNG and JPEG, the same JPEG fetched over loopback HTTP (the private-address rule
lifted for the measurement, as MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1 does), a WAV clip, and a video
sampled to frames with ffmpeg. Prints the median of several runs for each, in milliseconds.

    .venv/bin/python bench/media_overhead.py [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.server.media import MediaPolicy
from mlxcel.server.media.parts import ModelMedia, collect_media

MODEL = ModelMedia(frozenset({"text", "image", "video", "audio"}), video_max_frames=8)


def _picture(fmt: str, size: tuple[int, int]) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, quality=90)
    return out.getvalue()


def _wav(seconds: float) -> bytes:
    samples = (np.sin(np.arange(int(44100 * seconds)) / 8) * 12000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(44100)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


def _serve(body: bytes) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


def _time(parts: list[dict[str, Any]], policy: MediaPolicy, runs: int) -> float:
    messages = [{"role": "user", "content": parts}]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        asyncio.run(collect_media(messages, policy, MODEL))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    policy = MediaPolicy()
    png = _picture("PNG", (1280, 720))
    jpeg = _picture("JPEG", (1280, 720))
    server, port = _serve(jpeg)
    rows: list[tuple[str, float]] = []
    try:
        rows.append(("PNG 1280x720 data URI", _time(
            [{"type": "image_url", "image_url": {"url": _uri(png, "image/png")}}], policy, args.runs
        )))  # fmt: skip
        rows.append(("JPEG 1280x720 data URI", _time(
            [{"type": "image_url", "image_url": {"url": _uri(jpeg, "image/jpeg")}}], policy,
            args.runs,
        )))  # fmt: skip
        loopback = MediaPolicy(allow_private_urls=True)
        rows.append(("JPEG 1280x720 over loopback HTTP", _time(
            [{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/a.jpg"}}],
            loopback, args.runs,
        )))  # fmt: skip
        wav = base64.b64encode(_wav(10.0)).decode()
        rows.append(("WAV 10 s 44.1 kHz -> 16 kHz", _time(
            [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}], policy,
            args.runs,
        )))  # fmt: skip
        if shutil.which("ffmpeg"):
            with tempfile.TemporaryDirectory() as tmp:
                clip = Path(tmp) / "clip.mp4"
                subprocess.run(
                    ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i",
                     "testsrc=size=640x360:rate=25:duration=4", "-pix_fmt", "yuv420p", str(clip)],
                    check=True,
                )  # fmt: skip
                video = _uri(clip.read_bytes(), "video/mp4")
                rows.append(("video 640x360 4 s -> 8 frames (ffmpeg)", _time(
                    [{"type": "video_url", "video_url": {"url": video, "fps": 2}}], policy,
                    args.runs,
                )))  # fmt: skip
    finally:
        server.shutdown()
    print(f"media fetch + decode, median of {args.runs} runs (ms):")
    for name, ms in rows:
        print(f"  {name:<40} {ms:8.1f}")


if __name__ == "__main__":
    main()
