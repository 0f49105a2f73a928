"""Aggregate decode tok/s at 1, 4 and 8 concurrent streaming clients: `mlxcel serve` vs
`mlx_lm.server` on the same model, in one run.

The servers run at once on 127.0.0.1 (each idle while another is measured) and the
measurements alternate between them, so machine noise hits all alike. `mlx_lm.server` runs
twice: as installed (on Linux the MLX wheel's bundled reference BLAS) and with the system
OpenBLAS preloaded (the BLAS `mlxcel` loads itself), so the BLAS and the serving stack can
be told apart. Every client streams a chat completion (greedy; end-of-sequence tokens are
biased away, so every request decodes the same number of tokens). The aggregate rate is the
tokens after each stream's first, over the span from the earliest first token to the latest
last one. Prints medians, ranges and the ratios against the targets: 8 clients >= 3.5x one
client, and mlxcel >= 2.5x mlx_lm.server at 8 clients.

    .venv/bin/python bench/serve_concurrency.py [-m MLX_DIR] [-n TOKENS] [-r REPS]
        [-s mlxcel,mlx_lm,mlx_lm+blas] [--blas-threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PROMPTS,
    Server,
    aggregate_decode_rate,
    bench_model,
    concurrent_round,
    eos_bias,
    load_note,
    median,
    mlx_lm_server,
    mlxcel_server,
    param_count,
    spread,
    system_openblas,
)

TARGET_SCALING = 3.5
TARGET_VS_MLX_LM = 2.5


class _BudgetSpent(Exception):
    """The run's time budget is spent."""


def _bodies(n_clients: int, tokens: int, bias: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": tokens,
            "temperature": 0,
            "logit_bias": bias,
        }
        for i in range(n_clients)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", type=Path, default=None, help="MLX dir (default: 20M)")
    parser.add_argument("-n", "--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("-l", "--levels", default="1,4,8", help="client counts")
    parser.add_argument(
        "-s",
        "--servers",
        default="mlxcel,mlx_lm,mlx_lm+blas",
        help="which servers: mlxcel, mlx_lm (stock wheel), mlx_lm+blas (LD_PRELOAD OpenBLAS)",
    )
    parser.add_argument("--budget", type=float, default=900.0, help="stop after this many s")
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=None,
        help="OPENBLAS_NUM_THREADS for every server (default: the environment's)",
    )
    args = parser.parse_args()

    levels = [int(x) for x in args.levels.split(",")]
    model = args.model or bench_model()
    print(f"model: {model} ({param_count(model) / 1e6:.1f}M params), {args.tokens} tokens/req")
    bias = eos_bias(model)
    slots = max(levels)
    wanted = args.servers.split(",")
    blas = system_openblas()
    servers: dict[str, Server] = {}
    if "mlxcel" in wanted:
        servers["mlxcel"] = mlxcel_server(model, "-np", str(slots), "-c", str(2048 * slots))
    if "mlx_lm" in wanted:
        servers["mlx_lm"] = mlx_lm_server(model)
    if "mlx_lm+blas" in wanted and blas:
        servers["mlx_lm+blas"] = mlx_lm_server(model, blas=blas)
    threads = args.blas_threads or os.environ.get("OPENBLAS_NUM_THREADS", "default")
    if args.blas_threads:
        for server in servers.values():
            server.env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    print(
        f"system OpenBLAS: {blas or 'none'} (mlxcel loads it itself; see MLXCEL_BLAS), "
        f"OpenBLAS threads: {threads}"
    )
    deadline = time.monotonic() + args.budget
    rates: dict[tuple[str, int], list[float]] = {(s, n): [] for s in servers for n in levels}
    try:
        for server in servers.values():
            server.start()
            asyncio.run(concurrent_round(server.url, _bodies(slots, 4, bias)))  # warm-up
        for rep in range(args.reps):
            for n in levels:
                for name, server in servers.items():
                    if time.monotonic() > deadline:
                        raise _BudgetSpent
                    results = asyncio.run(
                        concurrent_round(server.url, _bodies(n, args.tokens, bias))
                    )
                    rate = aggregate_decode_rate(results)
                    rates[(name, n)].append(rate)
                    tokens = sorted({r.tokens for r in results})
                    print(
                        f"rep {rep + 1} {name:7} {n} clients: {rate:7.1f} tok/s "
                        f"(tokens/req {tokens}, {load_note()})",
                        flush=True,
                    )
    except _BudgetSpent:
        print(f"time budget of {args.budget:.0f}s spent; reporting what was measured")
    finally:
        for server in servers.values():
            server.stop()

    med = {key: median(values) for key, values in rates.items() if values}
    print()
    print(f"{'aggregate decode tok/s':28}" + "".join(f"{n:>10} cl" for n in levels))
    for name in servers:
        cells = "".join(f"{med.get((name, n), float('nan')):13.1f}" for n in levels)
        print(f"{name + ' (median)':28}{cells}")
        cells = "".join(
            f"{spread(rates[(name, n)]) if rates[(name, n)] else '-':>13}" for n in levels
        )
        print(f"{name + ' (range)':28}{cells}")
    top, one = max(levels), min(levels)
    for name in servers:
        if top > one and (name, top) in med and (name, one) in med and med[(name, one)] > 0:
            ratio = med[(name, top)] / med[(name, one)]
            target = f" (target >= {TARGET_SCALING}x)" if name == "mlxcel" else ""
            print(f"{name}: {top} clients / {one} client = {ratio:.2f}x{target}")
    for other in ("mlx_lm", "mlx_lm+blas"):
        if ("mlxcel", top) in med and (other, top) in med and med[(other, top)] > 0:
            ratio = med[("mlxcel", top)] / med[(other, top)]
            print(
                f"mlxcel / {other} at {top} clients = {ratio:.2f}x (target >= {TARGET_VS_MLX_LM}x)"
            )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
