"""The CPU path, before and after: bundled BLAS vs OpenBLAS, kept weights vs float32.

Each configuration runs `mlxcel bench --json` in its own process (the BLAS is chosen when a
process starts, before MLX loads), on the embedded default model (SmolLM2-135M, GGUF Q4_1)
and on the ~20M float32 llama fixture, and prints prefill/decode tok/s with the ratio to
the "before" configuration (MLX's bundled BLAS, weights as stored: what plain mlx-lm does).

    .venv/bin/python bench/cpu_path.py [-p 64] [-n 24] [-r 2]

For scale it also prints the ratio to llama-server on the same GGUF, from the reference
figures the speed issue quotes for a 2-core x86_64 box like this one (127-131 tok/s prefill,
63-73 decode; llama-server cannot be installed here, so it is not re-measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import ROOT, bench_model

MLXCEL = str(ROOT / ".venv" / "bin" / "mlxcel")
LLAMA_SERVER_REFERENCE = {"pp": 129.0, "tg": 68.0}  # midpoints of the ranges
TARGETS = {"pp": 0.5, "tg": 0.25}  # of llama-server, from the issue

CONFIGS = (
    ("before: bundled BLAS, weights kept", {"MLXCEL_BLAS": "off", "MLXCEL_CPU_DTYPE": "keep"}),
    ("OpenBLAS, weights kept", {"MLXCEL_BLAS": "auto", "MLXCEL_CPU_DTYPE": "keep"}),
    ("bundled BLAS, float32", {"MLXCEL_BLAS": "off", "MLXCEL_CPU_DTYPE": "float32"}),
    ("after: OpenBLAS, float32", {"MLXCEL_BLAS": "auto", "MLXCEL_CPU_DTYPE": "float32"}),
)


def run_bench(model: str | None, env: dict[str, str], args: argparse.Namespace) -> dict[str, float]:
    """{"pp": tok/s, "tg": tok/s, "blas": name} of one `mlxcel bench --json` process."""
    cmd = [MLXCEL, "bench", "-p", str(args.p), "-n", str(args.n), "-r", str(args.r), "--json"]
    if model:
        cmd += ["-m", model]
    out = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800
    )
    if out.returncode != 0:
        raise SystemExit(f"mlxcel bench failed: {out.stderr.strip().splitlines()[-1:]}")
    data = json.loads(out.stdout)
    rates = {r["kind"]: r["tokens_per_second"] for r in data["results"]}
    return {**rates, "blas": data["model"].get("blas", "?")}


def report(title: str, model: str | None, args: argparse.Namespace, *, gguf: bool) -> None:
    print(f"\n== {title} (pp{args.p}, tg{args.n}, {args.r} runs each)")
    rows = []
    for name, env in CONFIGS:
        rows.append((name, run_bench(model, env, args)))
    base = rows[0][1]
    header = f"{'configuration':38} {'pp t/s':>8} {'x':>6} {'tg t/s':>8} {'x':>6}"
    print(header + ("   vs llama-server pp / tg" if gguf else ""))
    for name, r in rows:
        line = (
            f"{name:38} {r['pp']:8.1f} {r['pp'] / base['pp']:5.2f}x"
            f" {r['tg']:8.2f} {r['tg'] / base['tg']:5.2f}x"
        )
        if gguf:
            pp = r["pp"] / LLAMA_SERVER_REFERENCE["pp"]
            tg = r["tg"] / LLAMA_SERVER_REFERENCE["tg"]
            line += f"   {pp:.2f}x / {tg:.2f}x"
        print(line)
    if gguf:
        after = rows[-1][1]
        for kind in ("pp", "tg"):
            ratio = after[kind] / LLAMA_SERVER_REFERENCE[kind]
            verdict = "met" if ratio >= TARGETS[kind] else "not met"
            print(f"target {kind} >= {TARGETS[kind]}x llama-server: {ratio:.2f}x ({verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=64, help="prompt tokens")
    parser.add_argument("-n", type=int, default=24, help="generated tokens")
    parser.add_argument("-r", type=int, default=2, help="timed runs per test")
    args = parser.parse_args()
    report("SmolLM2-135M-Instruct Q4_1 (embedded default)", None, args, gguf=True)
    fixture = bench_model()
    report(f"fixture: float32 llama {fixture.name}", str(fixture), args, gguf=False)
    print(
        "\n(float32 rows equal the kept rows on the fixture: its weights are float32 already.)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
