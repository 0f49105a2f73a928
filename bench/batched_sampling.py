"""The sampling step alone: per-request sampler closures (mlx-lm's row-by-row path) vs one
`BatchSampler` over the batch, on the same log-probabilities, in one run.

Eight rows with different temperatures and seeds (the other settings at llama-server's
defaults: top-k 40, top-p 0.95, min-p 0.05), at a small and a large vocabulary. Prints the
CPU time and the wall time per sampling step (medians over repetitions that alternate
between the two paths) and their ratios, and the BLAS MLX runs on. Both paths draw the
same tokens (tests/test_batched_sampling.py checks it); only the cost differs.

    .venv/bin/python bench/batched_sampling.py [-b ROWS] [-v 516,49152] [-r REPS] [-n STEPS]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlxcel.engine  # noqa: F401  (loads the BLAS before MLX, as the server does)
from mlxcel.engine.blas import blas_in_use

TEMPERATURES = (0.0, 0.5, 0.7, 0.9, 1.1, 1.3, 0.6, 0.8)


def _measure(step: Callable[[], object], n: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call of `step`, evaluated, over `n` calls."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(step())
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        mx.eval(step())
    return (time.process_time() - cpu) * 1000 / n, (time.perf_counter() - wall) * 1000 / n


def _compare(n_rows: int, vocab: int, reps: int, steps: int) -> None:
    import mlx.core as mx

    from mlxcel.engine.sampling.batched import BatchSampler, RowSampling
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.sampling.samplers import make_sampler

    params = [
        SamplingParams(temperature=TEMPERATURES[i % len(TEMPERATURES)], seed=i)
        for i in range(n_rows)
    ]
    logits = mx.random.normal((n_rows, vocab), key=mx.random.key(0))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    closures = [make_sampler(p) for p in params]
    rows = [RowSampling(p, vocab) for p in params]
    batch = BatchSampler()

    def per_row() -> object:
        # What GenerationBatch does when its rows hold different samplers.
        return mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(closures)])

    def batched() -> object:
        return batch.sample(rows, logprobs)

    runs: dict[str, list[tuple[float, float]]] = {"per-request": [], "batched": []}
    for _ in range(reps):
        runs["per-request"].append(_measure(per_row, steps))
        runs["batched"].append(_measure(batched, steps))
    med = {
        name: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
        for name, v in runs.items()
    }
    for name, (cpu, wall) in med.items():
        print(f"{vocab:>7} {name:>12} {cpu:12.2f} {wall:13.2f}")
    (c0, w0), (c1, w1) = med["per-request"], med["batched"]
    print(f"{vocab:>7} {'ratio':>12} {c0 / c1:11.2f}x {w0 / w1:12.2f}x  (per-request / batched)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-b", "--rows", type=int, default=8)
    parser.add_argument("-v", "--vocab", default="516,49152")
    parser.add_argument("-r", "--reps", type=int, default=5)
    parser.add_argument("-n", "--steps", type=int, default=100)
    args = parser.parse_args()
    print(f"BLAS: {blas_in_use()}; {args.rows} rows, temperatures {TEMPERATURES}")
    print(f"{'vocab':>7} {'path':>12} {'CPU ms/step':>12} {'wall ms/step':>13}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        _compare(args.rows, vocab, args.reps, args.steps)


if __name__ == "__main__":
    main()
