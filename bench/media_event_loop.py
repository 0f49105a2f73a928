"""How late the server's event loop runs while large media requests are being decoded.

Starts two `mlxcel serve` on a tiny Qwen2-VL (built with the test fixture, cached): one
decoding data URIs and pictures in its media worker processes (the default), one on its
media threads (`MLXCEL_MEDIA_PROCESSES=0`, as before the processes). For each load, rounds
alternate between the two servers: N concurrent chat requests that each carry a picture,
while `/health` is polled every 10 ms. Each server measures its own event loop
(bench/loop_probe on its PYTHONPATH: a 1 ms `call_later` ticker logs how late its ticks
ran, and how much of the worst one the loop thread waited for a CPU), so the figure is
the server's lag, apart from the HTTP client's latency and scheduling. The same ticker over
as long a stretch of the idle server gives the machine's floor; the load average is printed
before each round.

Loads: a 1280x720 noise PNG (~3.7 MB data URI), a 7000x7000 1-bit PNG (about 8 KB on the
wire, 49 M pixels once decoded) and a noise PNG sent as a ~21 MB data URI.

    .venv/bin/python bench/media_event_loop.py [-n 4] [--reps 5] [--loads 720p,bilevel,21mb]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import statistics
import sys
import tempfile
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


def noise_png(width: int = 2400, height: int = 2200) -> str:
    """A noise PNG (incompressible): about 21 MB as a data URI at the default size."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return _data_uri(Image.fromarray(pixels))


LOADS = {
    "720p": ("1280x720 noise PNG", lambda: noise_png(1280, 720)),
    "bilevel": ("7000x7000 1-bit PNG", bilevel_png),
    "21mb": ("~21 MB noise PNG", noise_png),
}
MODES = {"processes": "1", "threads": "0"}
"""Server label -> MLXCEL_MEDIA_PROCESSES."""


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


def _loop_lag(path: Path, began: float, ended: float) -> tuple[float, float, int, float]:
    """(worst lag ms, the loop's CPU wait ms within it, ticks over 5 ms late, the most a tick
    was late beyond its CPU wait ms) the probe logged for the seconds between two times."""
    worst, queued, over, rest = 0.0, 0.0, 0, 0.0
    for line in path.read_text().splitlines():
        second, _, lag, waited, late, beyond = line.split()
        if began - 1 < int(second) <= ended:
            over += int(late)
            rest = max(rest, float(beyond))
            if float(lag) > worst:
                worst, queued = float(lag), float(waited)
    return worst, queued, over, rest


def _idle_lag(path: Path, seconds: float) -> tuple[float, float]:
    """The worst lag of the idle server over `seconds` (the machine's floor), and the worst
    beyond the CPU wait (ms)."""
    began = time.time()
    time.sleep(seconds + 1.1)  # the probe writes each second once it is over
    worst, _, _, rest = _loop_lag(path, began + 1, began + seconds)
    return worst, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--clients", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--loads", default="720p,bilevel,21mb", help="comma-separated: " + ",".join(LOADS)
    )
    args = parser.parse_args()
    model = _tiny_vlm()
    loads = {LOADS[key][0]: LOADS[key][1]() for key in args.loads.split(",")}
    probe_dir = Path(__file__).resolve().parent / "loop_probe"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers, lag_files = {}, {}
        for mode, flag in MODES.items():
            lag_files[mode] = Path(tmp) / f"{mode}.lag"
            env = {"PYTHONPATH": str(probe_dir), "MLXCEL_LOOP_LAG": str(lag_files[mode])}
            env["MLXCEL_MEDIA_PROCESSES"] = flag
            argv = ("-c", "2048", "--max-body-size", str(64 << 20), "-np", str(args.clients))
            servers[mode] = stack.enter_context(mlxcel_server(model, *argv, env=env))
        for name, uri in loads.items():
            print(f"{name} ({len(uri) / 1e6:.2f} MB on the wire) x {args.clients}:")
            rows: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
            for server in servers.values():  # warm: worker processes, graphs
                _health_during(server.url, uri, args.clients)
            for _ in range(args.reps):
                for mode, server in servers.items():
                    print(f"  {mode}: {load_note()}")
                    began = time.time()
                    health = _health_during(server.url, uri, args.clients)
                    ended = time.time()
                    time.sleep(1.1)  # the probe writes each second once it is over
                    lag, waited, over, rest = _loop_lag(lag_files[mode], began, ended)
                    idle_for = min(max(ended - began, 1.0), 3.0)
                    floor, floor_rest = _idle_lag(lag_files[mode], idle_for)
                    for key, value in (("lag", lag), ("cpu wait", waited), ("over 5 ms", over),
                                       ("rest", rest), ("idle", floor),
                                       ("idle rest", floor_rest),
                                       ("health", max(health))):  # fmt: skip
                        rows[mode].setdefault(key, []).append(value)
            for mode, row in rows.items():
                med = {key: statistics.median(values) for key, values in row.items()}
                print(
                    f"  {mode:9s}: loop lag worst {med['lag']:.1f} ms (rounds "
                    f"{', '.join(f'{v:.1f}' for v in row['lag'])}; {med['cpu wait']:.1f} ms of it "
                    f"waiting for a CPU); worst beyond the CPU wait (the GIL, the loop's own "
                    f"work) {med['rest']:.1f} ms (rounds "
                    f"{', '.join(f'{v:.1f}' for v in row['rest'])}); "
                    f"{med['over 5 ms']:.0f} ticks over 5 ms a round; idle floor "
                    f"{med['idle']:.1f} ms ({med['idle rest']:.1f} beyond the CPU wait); "
                    f"/health worst {med['health']:.0f} ms"
                )


if __name__ == "__main__":
    main()
