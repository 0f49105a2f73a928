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

Clients: `--client lean` (the default) streams each request over a bare asyncio connection
(`_common.stream_chat_lean`), `--client httpx` through an `httpx.AsyncClient`. On a 2-core
machine the load generator shares the CPU with the server it measures: httpx took about
140 us of CPU per streamed token, the lean client about 35, which the report prints as
`client CPU`.

`--mixed`: every client asks for its own temperature and seed (0, 0.5, 0.7, ... 1.3; the
other settings at their defaults), the load batched sampling is for. The server
`mlxcel-per-request` is `mlxcel serve` with `MLXCEL_BATCHED_SAMPLING=0` (each request its
own sampler closure, called row by row: the path before batched sampling); with both in
`-s`, the ratio batched / per-request is printed per client count.

`--context N`: every client's prompt is padded to about N tokens (its own filler, the same
in every repetition: after the warm-up the prompt cache holds it, so a round measures
decoding against N keys). `--kv-types f32,f16`: one `mlxcel serve` per KV cache type
(`-ctk/-ctv`), named `mlxcel-<type>`, measured alternately.

    .venv/bin/python bench/serve_concurrency.py [-m MLX_DIR] [-n TOKENS] [-r REPS] [--mixed]
        [-s mlxcel,mlxcel-per-request,mlx_lm,mlx_lm+blas] [--route chat|completions]
        [--blas-threads N] [--client lean|httpx] [--context N] [--kv-types f32,f16]
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

from mlxcel.engine.blas import blas_in_use  # noqa: E402  (before anything imports MLX)

TARGET_SCALING = 3.5
TARGET_VS_MLX_LM = 2.5


def _cpu_seconds(server: Server) -> float:
    """The server process's CPU time so far (user + system, all threads; Linux /proc)."""
    if server.proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _BudgetSpent(Exception):
    """The run's time budget is spent."""


MIXED_TEMPERATURES = (0.0, 0.5, 0.7, 0.9, 1.1, 1.3, 0.6, 0.8)


def _padded_prompts(model: Path, context: int) -> list[str]:
    """`PROMPTS`, each after a filler of its own making it about `context` tokens long."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    out = []
    for i, prompt in enumerate(PROMPTS):
        unit = f"Note {i}: the archive keeps record {i} of the survey. "
        per_unit = max(1, len(tokenizer.encode(unit).ids))
        out.append(unit * max(0, (context - 40) // per_unit) + prompt)
    return out


def _bodies(
    n_clients: int,
    tokens: int,
    bias: dict[str, float],
    *,
    mixed: bool = False,
    route: str = "chat",
    prompts: list[str] | None = None,
) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    prompts = prompts or list(PROMPTS)
    for i in range(n_clients):
        prompt = prompts[i % len(prompts)]
        body: dict[str, Any] = (
            {"messages": [{"role": "user", "content": prompt}]}
            if route == "chat"
            else {"prompt": prompt}
        )
        body.update(max_tokens=tokens, temperature=0, logit_bias=bias)
        if mixed:
            body.update(temperature=MIXED_TEMPERATURES[i % len(MIXED_TEMPERATURES)], seed=i)
        bodies.append(body)
    return bodies


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
        help="which servers: mlxcel, mlxcel-per-request (MLXCEL_BATCHED_SAMPLING=0), "
        "mlx_lm (stock wheel), mlx_lm+blas (LD_PRELOAD OpenBLAS)",
    )
    parser.add_argument(
        "--mixed", action="store_true", help="a different temperature and seed per client"
    )
    parser.add_argument("--route", choices=("chat", "completions"), default="chat")
    parser.add_argument(
        "--client",
        choices=("lean", "httpx"),
        default="lean",
        help="load generator: a bare connection per stream, or httpx.AsyncClient",
    )
    parser.add_argument("--budget", type=float, default=900.0, help="stop after this many s")
    parser.add_argument("--context", type=int, default=0, help="prompt tokens (0: short)")
    parser.add_argument(
        "--kv-types", default="", help="mlxcel servers per KV cache type, e.g. f32,f16"
    )
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
    sampling = (
        "mixed temperatures " + ",".join(map(str, MIXED_TEMPERATURES)) if args.mixed else "greedy"
    )
    route = f"/v1/{'chat/' if args.route == 'chat' else ''}completions"
    print(f"sampling: {sampling}; route: {route}; client: {args.client}")
    bias = eos_bias(model)
    slots = max(levels)
    wanted = args.servers.split(",")
    blas = system_openblas()
    servers: dict[str, Server] = {}
    per_slot = max(2048, args.context + args.tokens + 256)
    prompts = _padded_prompts(model, args.context) if args.context else None
    if "mlxcel" in wanted and args.kv_types:
        for kv in args.kv_types.split(","):
            servers[f"mlxcel-{kv}"] = mlxcel_server(
                model, "-np", str(slots), "-c", str(per_slot * slots), "-ctk", kv, "-ctv", kv
            )
    elif "mlxcel" in wanted:
        servers["mlxcel"] = mlxcel_server(model, "-np", str(slots), "-c", str(per_slot * slots))
    if "mlxcel-per-request" in wanted:
        server = mlxcel_server(model, "-np", str(slots), "-c", str(2048 * slots))
        server.env["MLXCEL_BATCHED_SAMPLING"] = "0"
        servers["mlxcel-per-request"] = server
    if "mlx_lm" in wanted:
        servers["mlx_lm"] = mlx_lm_server(model)
    if "mlx_lm+blas" in wanted and blas:
        servers["mlx_lm+blas"] = mlx_lm_server(model, blas=blas)
    threads = args.blas_threads or os.environ.get("OPENBLAS_NUM_THREADS", "default")
    if args.blas_threads:
        for server in servers.values():
            server.env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    print(
        f"mlxcel's BLAS: {blas_in_use()}; system OpenBLAS: {blas or 'none'} "
        f"(for mlx_lm+blas); OpenBLAS threads: {threads}"
    )
    deadline = time.monotonic() + args.budget
    rates: dict[tuple[str, int], list[float]] = {(s, n): [] for s in servers for n in levels}
    per_cpu: dict[tuple[str, int], list[float]] = {(s, n): [] for s in servers for n in levels}
    client_us: dict[tuple[str, int], list[float]] = {(s, n): [] for s in servers for n in levels}
    try:
        for server in servers.values():
            server.start()
            warm = _bodies(slots, 4, bias, mixed=args.mixed, route=args.route, prompts=prompts)
            asyncio.run(  # warm-up
                concurrent_round(server.url, warm, route=args.route, client=args.client)
            )
        for rep in range(args.reps):
            for n in levels:
                for name, server in servers.items():
                    if time.monotonic() > deadline:
                        raise _BudgetSpent
                    bodies = _bodies(
                        n, args.tokens, bias, mixed=args.mixed, route=args.route, prompts=prompts
                    )
                    cpu, own = _cpu_seconds(server), time.process_time()
                    results = asyncio.run(
                        concurrent_round(server.url, bodies, route=args.route, client=args.client)
                    )
                    cpu, own = _cpu_seconds(server) - cpu, time.process_time() - own
                    rate = aggregate_decode_rate(results)
                    rates[(name, n)].append(rate)
                    if cpu > 0:
                        per_cpu[(name, n)].append(sum(r.tokens for r in results) / cpu)
                    tokens = sorted({r.tokens for r in results})
                    client_us[(name, n)].append(own / max(1, sum(r.tokens for r in results)) * 1e6)
                    print(
                        f"rep {rep + 1} {name:7} {n} clients: {rate:7.1f} tok/s, "
                        f"{per_cpu[(name, n)][-1] if cpu > 0 else 0:6.1f} tok/CPU-s "
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
    print(f"{'tokens per server CPU-second':28}" + "".join(f"{n:>10} cl" for n in levels))
    cpu_med = {key: median(values) for key, values in per_cpu.items() if values}
    for name in servers:
        cells = "".join(f"{cpu_med.get((name, n), float('nan')):13.1f}" for n in levels)
        print(f"{name + ' (median)':28}{cells}")
    header = f"client CPU us/token ({args.client})"
    print(f"{header:28}" + "".join(f"{n:>10} cl" for n in levels))
    for name in servers:
        cells = "".join(
            f"{median(client_us[(name, n)]) if client_us[(name, n)] else float('nan'):13.1f}"
            for n in levels
        )
        print(f"{name + ' (median)':28}{cells}")
    top, one = max(levels), min(levels)
    for name in servers:
        if top > one and (name, top) in med and (name, one) in med and med[(name, one)] > 0:
            ratio = med[(name, top)] / med[(name, one)]
            target = f" (target >= {TARGET_SCALING}x)" if name.startswith("mlxcel") else ""
            print(f"{name}: {top} clients / {one} client = {ratio:.2f}x{target}")
    if "mlxcel" in servers and "mlxcel-per-request" in servers:
        for n in levels:
            a, b = med.get(("mlxcel", n)), med.get(("mlxcel-per-request", n))
            c, d = cpu_med.get(("mlxcel", n)), cpu_med.get(("mlxcel-per-request", n))
            if a and b:
                print(
                    f"batched / per-request sampling at {n} clients = {a / b:.2f}x tok/s"
                    + (f", {c / d:.2f}x tokens per CPU-second" if c and d else "")
                )
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
