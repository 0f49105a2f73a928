"""Per-step overhead of a model split across two ranks against one process, on loopback.

Each round runs the same decode twice, alternating: in one process, and as two ranks
started by `mlx.launch --backend ring` on 127.0.0.1 (the engine's distributed lane: each
step's inputs sent from rank 0, the sampled tokens shared, the forward's own collectives).
Both load the ~20M-parameter float32 llama fixture (tensor parallel; `--pipeline` runs a
qwen2 of the same size split by layers) and decode `-n` tokens greedily from a short
prompt at one sequence and at `-b` sequences at once; the time per decode step is the
engine's own (`decode_seconds_total / decode_steps`), so loading and prefill are not in
it. Printed: each round's ms/step, the time of one all_sum between the ranks, and the
median ratio two ranks / one process. Both ranks share this machine's cores with each
other, so on a small box the ratio includes CPU contention, not only the loopback
collectives (a tensor-parallel decode step holds two sums per layer and two of the lane).

    .venv/bin/python bench/distributed_step.py [-n TOKENS] [-r ROUNDS] [-b BATCH] [--pipeline]
        [--rank-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIMS, BENCH_DIR, ROOT, bench_model, load_note, median  # noqa: E402

PROMPT = "Tell me about the morning train and the station."
RESULT = "DISTRIBUTED-STEP "


def _model(pipeline: bool) -> Path:
    if not pipeline:
        return bench_model()
    out = BENCH_DIR / ("qwen2-" + "-".join(str(v) for v in BENCH_DIMS.values()))
    if not (out / "generation_config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from fixtures.tiny_models import build_tiny_model

        build_tiny_model(out, "qwen2", **BENCH_DIMS)
    return out


def _worker(model: str, tokens: int, batch: int, pipeline: bool, threads: int) -> None:
    """One rank (or the lone process): load, decode, print the engine's ms per step."""
    from mlxcel.engine.distributed.group import join_group
    from mlxcel.engine.distributed.lane import lane_for
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.scheduler import TextEngine

    ranks = join_group()
    loaded = load_model(
        model, cpu_dtype="auto", cpu_threads=threads, ranks=ranks, pipeline=pipeline
    )
    engine = TextEngine(loaded, slots=batch, distributed=lane_for(ranks, 120.0))
    if ranks is not None and not ranks.leader:
        engine.follow()
        engine.stop()
        _all_sum_ms(ranks, loaded.model.args.hidden_size)
        return
    prompt = loaded.tokenizer.encode(PROMPT, add_special=True)
    results = {}
    for n_seq in sorted({1, batch}):
        for warm in (True, False):  # the first pass compiles and fills the allocator
            engine.forget_traffic()
            _decode(engine, [[*prompt, i] for i in range(n_seq)], 8 if warm else tokens)
        c = engine.counters
        results[str(n_seq)] = 1000 * c.decode_seconds_total / max(1, c.decode_steps)
    engine.stop()
    if ranks is not None:  # what one collective of a decode step's size costs here
        results["all_sum"] = _all_sum_ms(ranks, loaded.model.args.hidden_size)
    print(RESULT + json.dumps(results), flush=True)


def _all_sum_ms(ranks: Any, hidden: int, n: int = 50) -> float:
    """Milliseconds per all_sum of one sequence's hidden state between the ranks."""
    import time

    import mlx.core as mx

    x = mx.ones((1, hidden))
    mx.eval(mx.distributed.all_sum(x, group=ranks.group))
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(mx.distributed.all_sum(x, group=ranks.group))
    return 1000 * (time.perf_counter() - start) / n


def _decode(engine: Any, prompts: list[list[int]], tokens: int) -> None:
    """All `prompts` submitted at once (one batch), `tokens` each; back when all end."""
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationEvent, GenerationRequest

    left = [len(prompts)]
    done = threading.Event()

    def sink(event: GenerationEvent) -> None:
        if event.finished:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    for prompt in prompts:
        request = GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            ignore_eos=True,
            cache_prompt=False,
        )
        engine.submit(request, sink)
    done.wait(600)


def _run(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    for line in done.stdout.splitlines():
        if RESULT in line:
            return {k: float(v) for k, v in json.loads(line.split(RESULT, 1)[1]).items()}
    raise SystemExit(f"no result from {' '.join(argv[:3])}...:\n{done.stdout}\n{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--tokens", type=int, default=64)
    parser.add_argument("-r", "--rounds", type=int, default=3)
    parser.add_argument("-b", "--batch", type=int, default=4)
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument(
        "--rank-threads",
        type=int,
        default=-1,
        help="CPU kernel threads of each rank (-1: one per core, as the one process has)",
    )
    parser.add_argument("--threads", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.tokens, args.batch, args.pipeline, args.threads)
        return
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.rank_group import MLX_LAUNCH, free_ring_ports

    model = _model(args.pipeline)
    worker = [sys.executable, __file__, "--worker", str(model), "-n", str(args.tokens)]
    worker += ["-b", str(args.batch)] + (["--pipeline"] if args.pipeline else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_"))}
    hostfile = Path(tempfile.mkdtemp(prefix="mlxcel-bench-")) / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2))
    mode = "pipeline (qwen2)" if args.pipeline else "tensor (llama)"
    print(f"{model.name}: {mode} parallel, {args.tokens} tokens, {load_note()}")
    ratios: dict[str, list[float]] = {}
    for r in range(args.rounds):
        one = _run(worker, env)
        port = str(free_ring_ports(2))
        launch = [str(MLX_LAUNCH), "--backend", "ring", "--hostfile", str(hostfile)]
        ranks = [*worker, "--threads", str(args.rank_threads)]
        two = _run([*launch, "--starting-port", port, "--", *ranks], env)
        print(f"round {r + 1}: one all_sum between the ranks {two.pop('all_sum'):.2f} ms")
        for n_seq in one:
            ratio = two[n_seq] / one[n_seq]
            ratios.setdefault(n_seq, []).append(ratio)
            print(
                f"round {r + 1}, {n_seq} sequence(s): one process {one[n_seq]:.2f} ms/step, "
                f"two ranks {two[n_seq]:.2f} ms/step, ratio {ratio:.2f}"
            )
    shutil.rmtree(hostfile.parent, ignore_errors=True)
    for n_seq, values in ratios.items():
        print(
            f"median two ranks / one process at {n_seq} sequence(s): {median(values):.2f}x "
            f"(rounds {min(values):.2f}-{max(values):.2f})"
        )


if __name__ == "__main__":
    main()
