"""Vision continuous batching, media preparation off the event loop, and the prompt cache.

On the tiny Qwen2-VL and Gemma 3 fixtures (tests/fixtures/tiny_vlm.py, built once under
the bench directory), through `VisionEngine` in this process:

1. N concurrent requests that each carry a picture (N = 4, 8) on an N-slot engine vs the
   same requests one after another on a one-slot engine: wall time and the speed-up;
2. the event loop's longest stall while requests with an unprepared 1280x720 picture are
   submitted from it and run (a 1 ms ticker on the loop), vs the processor run on the loop
   as the one-slot engine's `submit` used to;
   and, through `mlxcel serve` on the tiny Qwen2-VL, the worst `/health` latency while 4
   chat requests with a 1280x720 picture (a data URI) are decoded, prepared and answered,
   beside the idle server's (the machine's floor) and the server's longest event-loop
   callback meanwhile, in CPU and wall time (bench/loop_probe on its PYTHONPATH);
3. time to first token of a follow-up turn about the same picture with the prompt cache vs
   cold (no cache); the first turn stays within Gemma 3's 512-token sliding window (the
   prompt cache takes no rotating KV cache that has wrapped).

Every ratio comes from timings of one run.

    .venv/bin/python bench/vision_concurrency.py [--tokens 128] [--reps 3] [--health-only]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DIR, ROOT, load_note  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = {
    "qwen2_vl": "<|im_start|>user\n{text}<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "<bos><start_of_turn>user\n{text}<start_of_image><end_of_turn>\n"
    "<start_of_turn>model\n",
}
FOLLOW_UP = {
    "qwen2_vl": "{answer}<|im_end|>\n<|im_start|>user\nAnd its colour?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "gemma3": "{answer}<end_of_turn>\n<start_of_turn>user\nAnd its colour?<end_of_turn>\n"
    "<start_of_turn>model\n",
}
LONG_TEXT = " ".join(f"The {i}th line of a long description of the picture." for i in range(12))


def _model(kind: str) -> Any:
    from fixtures.tiny_vlm import build_tiny_gemma3, build_tiny_qwen2_vl

    from mlxcel.engine.vision.loader import load_vision_model

    out = BENCH_DIR / f"tiny-{kind}"
    if not (out / "config.json").is_file():
        (build_tiny_qwen2_vl if kind == "qwen2_vl" else build_tiny_gemma3)(out)
    return load_vision_model(out, name=kind)


def _picture(i: int, size: tuple[int, int] = (64, 64)) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(i).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _request(kind: str, text: str, picture: Any, tokens: int) -> Any:
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt

    return GenerationRequest(
        prompt_tokens=[],
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        media=VisionPrompt(PROMPTS[kind].format(text=text), VisionInputs(images=[picture])),
    )


def _wait(sinks: list[queue.SimpleQueue[Any]]) -> list[float]:
    """Each request's time of its first token (perf_counter), waiting for all to finish."""
    firsts = []
    for sink in sinks:
        first = 0.0
        while not (event := sink.get(timeout=600)).finished:
            if event.token_ids and not first:
                first = time.perf_counter()
        assert event.finish_reason == "length", event.error
        firsts.append(first)
    return firsts


def concurrency(loaded: Any, kind: str, n: int, tokens: int, reps: int) -> tuple[float, float]:
    """(one after another, concurrent) seconds for `n` picture requests, medians."""
    from mlxcel.engine.vision.engine import VisionEngine

    def batch() -> list[Any]:
        return [
            _request(kind, f"Picture {i}: what is in it?", _picture(i), tokens) for i in range(n)
        ]

    serial_engine = VisionEngine(loaded, slots=1)
    batched_engine = VisionEngine(loaded, slots=n)
    serial, together = [], []
    try:
        for engine in (serial_engine, batched_engine):  # warm both
            list(engine.generate(batch()[0]))
        for _ in range(reps):
            requests = batch()
            for r in requests:
                serial_engine.prepare(r.media)
            start = time.perf_counter()
            for r in requests:
                sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
                serial_engine.submit(r, sink.put)
                _wait([sink])
            serial.append(time.perf_counter() - start)
            requests = batch()
            for r in requests:
                batched_engine.prepare(r.media)
            start = time.perf_counter()
            sinks = []
            for r in requests:
                sinks.append(queue.SimpleQueue())
                batched_engine.submit(r, sinks[-1].put)
            _wait(sinks)
            together.append(time.perf_counter() - start)
    finally:
        serial_engine.stop()
        batched_engine.stop()
    return statistics.median(serial), statistics.median(together)


async def _longest_stall(work: Callable[[], Any]) -> float:
    """The longest gap between ticks of a 1 ms ticker on this loop while `work()` (started
    on the loop, awaited to its end) runs."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await work()
    done.set()
    await task
    return max(gaps)


def event_loop_stall(loaded: Any, kind: str, n: int, tokens: int, reps: int) -> tuple[float, float]:
    """(stall with preparation in submit's caller, stall now) in seconds, medians over
    `reps` loads of `n` requests with an unprepared 1280x720 picture submitted from the
    loop. What remains now is the GIL: the engine thread's processor work holds it for up
    to the interpreter's switch interval (5 ms) at a time."""
    from mlxcel.engine.vision.engine import VisionEngine

    engine = VisionEngine(loaded, slots=n)
    list(engine.generate(_request(kind, "warm", _picture(99), 2)))

    def submit_all(prepare_here: bool) -> Callable[[], Any]:
        pictures = [_picture(100 + i, (1280, 720)) for i in range(n)]

        async def run() -> None:
            loop = asyncio.get_running_loop()
            finished = [loop.create_future() for _ in range(n)]
            for i in range(n):
                request = _request(kind, "What is it?", pictures[i], tokens)
                if prepare_here:  # what the one-slot engine's submit did on its caller
                    engine.prepare(request.media)

                def sink(event: Any, done: asyncio.Future[None] = finished[i]) -> None:
                    if event.finished:
                        loop.call_soon_threadsafe(done.set_result, None)

                engine.submit(request, sink)
                await asyncio.sleep(0)
            await asyncio.gather(*finished)

        return run

    before, after = [], []
    try:
        for _ in range(reps):
            before.append(asyncio.run(_longest_stall(submit_all(prepare_here=True))))
            after.append(asyncio.run(_longest_stall(submit_all(prepare_here=False))))
    finally:
        engine.stop()
    return statistics.median(before), statistics.median(after)


def health_during_pictures(clients: int, reps: int) -> dict[str, float]:
    """Medians over `reps` loads of `clients` chat requests with a 1280x720 noise picture
    on `mlxcel serve` over the tiny Qwen2-VL: `/health`'s worst and median latency (ms),
    the same over as many probes of the idle server (this machine's floor, in the same
    run), and the server's longest event-loop callback during each load in thread CPU time
    and in wall time (bench/loop_probe)."""
    import base64
    import io
    import tempfile

    import httpx
    from _common import mlxcel_server
    from media_event_loop import _health_during

    out = io.BytesIO()
    _picture(5, (1280, 720)).save(out, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    _model("qwen2_vl")  # built once
    rounds: dict[str, list[float]] = {}
    with tempfile.NamedTemporaryFile(suffix=".loop") as probe_file:
        env = {"PYTHONPATH": str(Path(__file__).parent / "loop_probe")}
        env["MLXCEL_LOOP_PROBE"] = probe_file.name
        model = BENCH_DIR / "tiny-qwen2_vl"
        with mlxcel_server(model, "-c", "4096", "-np", str(clients), env=env) as server:
            _health_during(server.url, uri, clients)  # warm
            for _ in range(reps):
                began = time.time()
                latencies = _health_during(server.url, uri, clients)
                callbacks = _loop_callbacks(Path(probe_file.name), began, time.time())
                idle = []
                with httpx.Client(base_url=server.url, timeout=60) as probe:
                    for _ in latencies:
                        sent = time.perf_counter()
                        probe.get("/health")
                        idle.append((time.perf_counter() - sent) * 1000)
                        time.sleep(0.01)
                row = {
                    "worst": max(latencies),
                    "median": statistics.median(latencies),
                    "idle worst": max(idle),
                    "idle median": statistics.median(idle),
                    **_longest(callbacks),
                }
                for key, value in row.items():
                    rounds.setdefault(key, []).append(value)
    out = {key: statistics.median(values) for key, values in rounds.items()}
    # The longest callback's parts from one round (the median one by wall time), so that
    # they add up to its wall time.
    middle = sorted(range(reps), key=lambda i: rounds["loop wall"][i])[reps // 2]
    for key in ("loop wall", "wall cpu", "wall runqueue", "wall gil"):
        out[key] = rounds[key][middle]
    return out


def _loop_callbacks(path: Path, began: float, ended: float) -> list[tuple[float, float, float]]:
    """(wall, CPU, run-queue wait) ms of the loop callbacks the probe logged between two
    times."""
    out = []
    for line in path.read_text().splitlines():
        at, wall, cpu, queued = (float(x) for x in line.split())
        if began <= at <= ended:
            out.append((wall, cpu, queued))
    return out


def _longest(callbacks: list[tuple[float, float, float]]) -> dict[str, float]:
    """The most CPU one loop callback took, and the longest one in wall time with what its
    wall time was: CPU, waiting for a CPU, the rest (waiting for the GIL)."""
    wall, cpu, queued = max(callbacks, default=(0.0, 0.0, 0.0))
    return {
        "loop cpu": max((c for _, c, _ in callbacks), default=0.0),
        "loop wall": wall,
        "wall cpu": cpu,
        "wall runqueue": queued,
        "wall gil": max(0.0, wall - cpu - queued),
    }


def follow_up_ttft(loaded: Any, kind: str, reps: int) -> tuple[float, float, int]:
    """(cold, cached) time to first token of a follow-up turn about the same picture, and
    the tokens the cache served."""
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.vision.engine import VisionEngine
    from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt

    picture = _picture(7, (640, 480))
    cold, cached, served = [], [], 0
    for rep in range(reps + 1):
        cache = PromptCache()
        with_cache = VisionEngine(loaded, slots=1, prompt_cache=cache)
        without = VisionEngine(loaded, slots=1)
        try:
            first = _request(kind, LONG_TEXT, picture, 16)
            answer = "".join(e.text for e in with_cache.generate(first))
            text = first.media.text + FOLLOW_UP[kind].format(answer=answer)
            times = []
            for engine in (without, with_cache):
                follow = _request(kind, "", picture, 4)
                follow.media = VisionPrompt(text, VisionInputs(images=[picture]))
                engine.prepare(follow.media)  # as the server does, before submit
                sink: queue.SimpleQueue[Any] = queue.SimpleQueue()
                start = time.perf_counter()
                engine.submit(follow, sink.put)
                events = []
                while not (event := sink.get(timeout=600)).finished:
                    events.append((time.perf_counter(), event))
                times.append(next(t for t, e in events if e.token_ids) - start)
                if engine is with_cache:
                    served = event.timings.cache_n
            if rep:  # the first round warms both engines' graphs
                cold.append(times[0])
                cached.append(times[1])
        finally:
            with_cache.stop()
            without.stop()
    return statistics.median(cold), statistics.median(cached), served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--health-only", action="store_true", help="only the /health part")
    args = parser.parse_args()
    print(load_note())
    if args.health_only:
        print_health(args.reps)
        return
    for kind in ("qwen2_vl", "gemma3"):
        loaded = _model(kind)
        print(f"\n== tiny {kind} ({args.tokens} tokens a request, medians of {args.reps})")
        for n in (4, 8):
            serial, together = concurrency(loaded, kind, n, args.tokens, args.reps)
            print(
                f"{n} picture requests: one after another {serial * 1000:7.0f} ms, "
                f"concurrent on {n} slots {together * 1000:7.0f} ms: {serial / together:.2f}x"
            )
        before, after = event_loop_stall(loaded, kind, 4, 8, args.reps)
        print(
            f"event loop's longest stall (median of {args.reps}), 4 requests with a 1280x720 "
            f"picture: processor on the loop {before * 1000:.1f} ms, now {after * 1000:.1f} ms"
        )
        cold, cached, served = follow_up_ttft(loaded, kind, args.reps)
        print(
            f"follow-up turn about the same picture, time to first token: cold "
            f"{cold * 1000:.1f} ms, cached {cached * 1000:.1f} ms ({served} tokens from the "
            f"cache): {cold / cached:.2f}x"
        )
    print_health(args.reps)


def print_health(reps: int) -> None:
    h = health_during_pictures(4, reps)
    print(
        f"\nmlxcel serve, tiny qwen2_vl, 4 chat requests with a 1280x720 picture (medians of "
        f"{reps}): /health worst {h['worst']:.1f} ms, median {h['median']:.1f} ms; the idle "
        f"server, as many probes: worst {h['idle worst']:.1f} ms, median "
        f"{h['idle median']:.1f} ms.\nThe event loop's callbacks during the load: the most "
        f"CPU one took {h['loop cpu']:.1f} ms; the longest took {h['loop wall']:.1f} ms wall: "
        f"{h['wall cpu']:.1f} ms CPU, {h['wall runqueue']:.1f} ms waiting for a CPU, "
        f"{h['wall gil']:.1f} ms for the GIL"
    )


if __name__ == "__main__":
    main()
