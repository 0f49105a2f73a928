"""The CPU path, before and after: reference BLAS vs OpenBLAS; kept weights, float32, kernel.

Each configuration runs `mlxcel bench --json` in its own process (the BLAS is chosen when a
process starts, before MLX loads), on the embedded default model (SmolLM2-135M, GGUF Q4_1)
and on the ~20M float32 llama fixture, and prints prefill/decode tok/s with the ratio to
the "before" configuration (MLX's bundled BLAS, weights as stored: what plain mlx-lm does).

    .venv/bin/python bench/cpu_path.py [-p 64] [-n 24] [-r 2] [--llama-bench PATH]

"after" is the default (`--cpu-dtype auto`, `MLXCEL_BLAS=auto`): where the CPU has AVX-512
VNNI the quantized layers are repacked into the kernel's int8 tiles, which serve decode and
prefill alike with int8 activations (elsewhere decode runs on the kernel and prefill on a
float32 copy through OpenBLAS, the PyPI one unless a system OpenBLAS is installed). The row
before it is the same with `MLXCEL_KERNEL_INT8=off` (MLX's layout and float32 activations,
prefill on the float32 copy).

For scale it prints the ratio to llama.cpp on the same GGUF: pass `--llama-bench PATH` (a
`llama-bench` built from llama.cpp; it runs before and after mlxcel's configurations, with
as many threads as there are cores, and the mean of the two is used), else the reference
figures the speed issue quotes for a 2-core x86_64 box (llama-server 127-131 tok/s
prefill, 63-73 decode) are used and labelled as such.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from _common import ROOT, bench_model
from llama_bench import find_llama_bench, llama_bench_rates, mlxcel_bench, rates_of

LLAMA_SERVER_REFERENCE = {"pp": 129.0, "tg": 68.0}  # midpoints of the ranges
TARGETS = {"pp": 1.0, "tg": 0.6}  # of llama.cpp, from issue 18

CONFIGS = (
    ("before: reference BLAS, weights kept", {"MLXCEL_BLAS": "off", "MLXCEL_CPU_DTYPE": "keep"}),
    ("reference BLAS + kernel (auto, no BLAS)", {"MLXCEL_BLAS": "off", "MLXCEL_CPU_DTYPE": "auto"}),
    ("OpenBLAS, float32", {"MLXCEL_BLAS": "auto", "MLXCEL_CPU_DTYPE": "float32"}),
    (
        "OpenBLAS + kernel, float32 activations",
        {"MLXCEL_BLAS": "auto", "MLXCEL_CPU_DTYPE": "auto", "MLXCEL_KERNEL_INT8": "off"},
    ),
    ("after: OpenBLAS + kernel, int8 (auto)", {"MLXCEL_BLAS": "auto", "MLXCEL_CPU_DTYPE": "auto"}),
)


def run_bench(model: str | None, env: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s, "blas": name} of one `mlxcel bench --json` process."""
    data = mlxcel_bench(model, args.p, args.n, args.r, env=env)
    return {**rates_of(data), "blas": data["model"].get("blas", "?")}


def default_gguf() -> str:
    """Path of the embedded default model's GGUF (for llama-bench)."""
    code = "from mlxcel.engine.loading.default_model import default_model_path as p; print(p())"
    python = str(ROOT / ".venv" / "bin" / "python")
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def llama_cpp_rates(binary: str | None, args: argparse.Namespace) -> tuple[dict[str, float], str]:
    """llama.cpp's {"pp", "tg"} tok/s on the same GGUF, and where they come from."""
    if not binary:
        return LLAMA_SERVER_REFERENCE, "llama-server (issue's reference figures, not re-measured)"
    threads = os.cpu_count() or 1
    rates = llama_bench_rates(binary, default_gguf(), args.p, args.n, max(2, args.r), threads)
    return rates, f"llama.cpp {Path(binary).name}, same GGUF, measured in this run"


def report(
    title: str,
    model: str | None,
    args: argparse.Namespace,
    *,
    reference: tuple[dict[str, float], str] | None,
) -> None:
    print(f"\n== {title} (pp{args.p}, tg{args.n}, {args.r} runs each)")
    gguf = reference is not None
    rows = []
    for name, env in CONFIGS:
        rows.append((name, run_bench(model, env, args)))
    llama = dict(reference[0]) if reference else {}
    if gguf and args.llama_bench:
        after, _ = llama_cpp_rates(args.llama_bench, args)
        print(
            f"llama.cpp before mlxcel's runs: pp {llama['pp']:.1f}, tg {llama['tg']:.1f} tok/s; "
            f"after: pp {after['pp']:.1f}, tg {after['tg']:.1f} (the mean is used)"
        )
        llama = {kind: (llama[kind] + after[kind]) / 2 for kind in ("pp", "tg")}
    base = rows[0][1]
    header = f"{'configuration':42} {'pp t/s':>8} {'x':>6} {'tg t/s':>8} {'x':>6}"
    print(header + ("   vs llama.cpp pp / tg" if gguf else ""))
    for name, r in rows:
        line = (
            f"{name:42} {r['pp']:8.1f} {r['pp'] / base['pp']:5.2f}x"
            f" {r['tg']:8.2f} {r['tg'] / base['tg']:5.2f}x"
        )
        if gguf:
            pp = r["pp"] / llama["pp"]
            tg = r["tg"] / llama["tg"]
            line += f"   {pp:.2f}x / {tg:.2f}x"
        print(line)
    if reference is not None:
        print(f"llama.cpp: pp {llama['pp']:.1f} tok/s, tg {llama['tg']:.1f} tok/s ({reference[1]})")
        after = rows[-1][1]
        for kind in ("pp", "tg"):
            ratio = after[kind] / llama[kind]
            verdict = "met" if ratio >= TARGETS[kind] else "not met"
            print(f"target {kind} >= {TARGETS[kind]}x llama.cpp: {ratio:.2f}x ({verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=64, help="prompt tokens")
    parser.add_argument("-n", type=int, default=24, help="generated tokens")
    parser.add_argument("-r", type=int, default=2, help="timed runs per test")
    parser.add_argument(
        "--llama-bench", help="a llama.cpp llama-bench binary (else $LLAMA_BENCH, else PATH)"
    )
    args = parser.parse_args()
    args.llama_bench = find_llama_bench(args.llama_bench)
    reference = llama_cpp_rates(args.llama_bench, args)
    report("SmolLM2-135M-Instruct Q4_1 (embedded default)", None, args, reference=reference)
    fixture = bench_model()
    report(f"fixture: float32 llama {fixture.name}", str(fixture), args, reference=None)
    print(
        "\n(on the fixture every weight is float32 already: the dtype rows equal the kept ones.)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
