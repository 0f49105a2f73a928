"""MLX's CPU float32 work on each BLAS, side by side in one run: the reference BLAS the
`mlx[cpu]` wheel bundles, the PyPI OpenBLAS (scipy-openblas32 through mlxcel's shim, the
pip-only default) and a system OpenBLAS when one is given or found.

Each BLAS runs in its own process (the BLAS is chosen when a process starts, before MLX
loads), alternating over the repetitions, and measures

- `matmul`: a 512x512 @ 512x512 float32 matmul (GFLOP/s);
- `prefill`: a 128-token prompt through the ~20M float32 llama fixture (tok/s);
- `embed`: 32 texts embedded with the shipped all-MiniLM-L6-v2 in one batch (texts/s).

It prints each figure with its ratio to the reference BLAS and the BLAS each process
reported (`mlxcel.engine.blas.blas_in_use`).

    .venv/bin/python bench/blas.py [-r 3] [--system PATH/libopenblas.so.0]

Without `--system`, a system OpenBLAS is used when the dynamic linker finds one.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_model  # noqa: E402

PREFILL_TOKENS = 128
EMBED_TEXTS = 32


def _best(run: Any, reps: int) -> float:
    """Median seconds of `reps` calls of `run` after one warm-up call."""
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(model_dir: str) -> dict[str, Any]:
    """Measure the three workloads in this process, on whatever BLAS `MLXCEL_BLAS` chose."""
    import mlxcel.engine  # noqa: F401  (chooses the BLAS before mlx.core loads)
    from mlxcel.engine.blas import blas_in_use

    # isort: split
    import mlx.core as mx
    import numpy as np

    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    a = mx.array(rng.standard_normal((512, 512)).astype(np.float32))
    b = mx.array(rng.standard_normal((512, 512)).astype(np.float32))
    matmul_s = _best(lambda: mx.eval(a @ b), 10)

    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.loading import load_model

    loaded = load_model(model_dir, cpu_dtype="keep")
    ids = mx.array([list(range(1, PREFILL_TOKENS + 1))])

    def prefill() -> None:
        mx.eval(loaded.model(ids, cache=make_prompt_cache(loaded.model)))

    prefill_s = _best(prefill, 3)

    from mlxcel.engine.embeddings import load_embedder

    embedder = load_embedder(None)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "near",
        "the",
        "river",
        "bank",
    ]
    texts = [" ".join(words[i % 7 :] + words[: i % 5 + 3]) for i in range(EMBED_TEXTS)]
    embed_s = _best(lambda: embedder.embed(texts, batch_size=EMBED_TEXTS).matrix(), 3)
    return {
        "blas": blas_in_use(),
        "matmul": 2 * 512**3 / matmul_s / 1e9,
        "prefill": PREFILL_TOKENS / prefill_s,
        "embed": EMBED_TEXTS / embed_s,
    }


def run_worker(env: dict[str, str], model_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", model_dir]
    done = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({env}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--reps", type=int, default=3, help="processes per BLAS")
    parser.add_argument("--system", help="a system OpenBLAS library (default: if found)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return

    model_dir = str(bench_model())
    configs: list[tuple[str, dict[str, str]]] = [
        ("reference BLAS (mlx[cpu] wheel)", {"MLXCEL_BLAS": "off"}),
        ("PyPI OpenBLAS (scipy-openblas32 + shim)", {"MLXCEL_BLAS": "pypi"}),
    ]
    system = args.system or ctypes.util.find_library("openblas")
    if system:
        configs.append(("system OpenBLAS", {"MLXCEL_BLAS": system}))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for _ in range(args.reps):
        for name, env in configs:
            results[name].append(run_worker(env, model_dir))

    cores = os.cpu_count()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "1" if (cores or 1) <= 4 else "default")
    print(
        f"MLX CPU float32 on each BLAS: {cores} cores, OpenBLAS threads {threads}, "
        f"{args.reps} process(es) each: median (range of the ratio to the reference BLAS)"
    )
    kinds = (("matmul", "GFLOP/s"), ("prefill", "tok/s"), ("embed", "texts/s"))
    header = f"{'BLAS':<42}" + "".join(f"{k + ' ' + unit:>24}" for k, unit in kinds)
    print(header)
    reference = results[configs[0][0]]
    for name, _ in configs:
        cells = []
        for kind, _ in kinds:
            value = statistics.median(r[kind] for r in results[name])
            # each repetition's ratio comes from processes run back to back
            ratios = [r[kind] / b[kind] for r, b in zip(results[name], reference, strict=True)]
            cells.append(f"{value:>8.1f} ({min(ratios):.1f}-{max(ratios):.1f}x)")
        print(f"{name:<42}" + "".join(f"{c:>24}" for c in cells))
    for name, _ in configs:
        print(f"  {name}: ran on {results[name][0]['blas']}")


if __name__ == "__main__":
    main()
