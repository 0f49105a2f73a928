"""How long `/health` waits while large media requests are being decoded.

Starts `mlxcel serve` on a tiny Qwen2-VL (built with the test fixture, cached), sends N
concurrent chat requests that each carry a large picture, and polls `/health` every 10 ms
from the start of the load until the last request answers. A server that decodes media on
its event loop leaves `/health` waiting for the whole decode; one that decodes on worker
threads answers at once. Two loads: a 7000x7000 1-bit PNG (about 8 KB on the wire, 49 M
pixels once decoded) and a noise PNG sent as a ~21 MB data URI.

    .venv/bin/python bench/media_event_loop.py [-n 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DIR, ROOT, load_note, mlxcel_server  # noqa: E402


def _tiny_vlm() -> Path:
    out = BENCH_DIR / "qwen2-vl-tiny"
    if not (out / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from fixtures.tiny_vlm import build_tiny_qwen2_vl

        build_tiny_qwen2_vl(out)
    return out


def _data_uri(picture: object) -> str:
    out = io.BytesIO()
    picture.save(out, format="PNG")  # type: ignore[attr-defined]
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def bilevel_png() -> str:
    """A 7000x7000 1-bit PNG: tiny on the wire, 49 M pixels to decode."""
    from PIL import Image

    return _data_uri(Image.new("1", (7000, 7000), 1))


def noise_png() -> str:
    """A noise PNG (incompressible) whose data URI is about 21 MB."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (2200, 2400, 3), dtype=np.uint8)
    return _data_uri(Image.fromarray(pixels))


def _health_during(url: str, uri: str, clients: int) -> list[float]:
    """/health latencies in ms while `clients` requests carrying `uri` are in flight.

    The load runs on threads and the probe on this one, each with its own connection, so
    the probe's latency is the server's (not the load generator's own event loop)."""
    body = {
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": uri}}]},
        ],
        "max_tokens": 1,
    }  # fmt: skip
    # Encoded once here: encoding megabytes on the load threads would hold this process's
    # GIL and delay the probe, which would then time this process rather than the server.
    raw = json.dumps(body).encode()

    def one() -> int:
        with httpx.Client(base_url=url, timeout=300) as http:
            headers = {"content-type": "application/json"}
            return http.post("/v1/chat/completions", content=raw, headers=headers).status_code

    latencies: list[float] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool, httpx.Client(base_url=url, timeout=300) as probe:
        load = [pool.submit(one) for _ in range(clients)]
        time.sleep(0.05)  # let the bodies go out first
        while not all(task.done() for task in load):
            sent = time.perf_counter()
            probe.get("/health")
            latencies.append((time.perf_counter() - sent) * 1000)
            time.sleep(0.01)
        codes = sorted({task.result() for task in load})
    wall = time.perf_counter() - started
    print(f"    answers {codes}, load {wall:.2f} s, {len(latencies)} /health probes")
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--clients", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    model = _tiny_vlm()
    loads = {"7000x7000 1-bit PNG": bilevel_png(), "~21 MB data URI": noise_png()}
    print(load_note())
    with mlxcel_server(model, "-c", "2048", "--max-body-size", str(64 << 20)) as server:
        for name, uri in loads.items():
            worst: list[float] = []
            medians: list[float] = []
            print(f"{name} ({len(uri) / 1e6:.2f} MB on the wire) x {args.clients}:")
            for _ in range(args.reps):
                latencies = _health_during(server.url, uri, args.clients)
                worst.append(max(latencies))
                medians.append(statistics.median(latencies))
            print(
                f"  /health: worst {statistics.median(worst):.0f} ms "
                f"(runs {', '.join(f'{w:.0f}' for w in worst)}), "
                f"median {statistics.median(medians):.0f} ms"
            )


if __name__ == "__main__":
    main()
