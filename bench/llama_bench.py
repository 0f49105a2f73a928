"""Run llama.cpp's `llama-bench` and `mlxcel bench` as subprocesses: their pp/tg tok/s.

Shared by `bench/cpu_path.py` and `bench/gguf_vs_llama.py`. Both tools are asked for the
same llama-bench-style tests (`-p N`: a prompt of N tokens, rated in prompt tokens a
second; `-n N`: N generated tokens) with the same thread count.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from _common import ROOT

MLXCEL = str(ROOT / ".venv" / "bin" / "mlxcel")
LLAMA_BENCH_ENV = "LLAMA_BENCH"
"""Environment variable naming a `llama-bench` binary (else `--llama-bench`, else PATH)."""

Rates = dict[str, float]


def find_llama_bench(given: str | None) -> str | None:
    """The llama-bench to run: `given`, else $LLAMA_BENCH, else one on PATH, else None."""
    for candidate in (given, os.environ.get(LLAMA_BENCH_ENV), shutil.which("llama-bench")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    if given:
        raise SystemExit(f"llama-bench not found or not executable: {given}")
    return None


def llama_bench_rates(
    binary: str, gguf: str, n_prompt: int, n_gen: int, repetitions: int, threads: int
) -> Rates:
    """llama.cpp's {"pp", "tg"} tok/s (each the mean of `repetitions` runs) on `gguf`."""
    cmd = [binary, "-m", gguf, "-p", str(n_prompt), "-n", str(n_gen)]
    cmd += ["-r", str(repetitions), "-t", str(threads), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"llama-bench failed: {out.stderr.strip().splitlines()[-1:]}")
    rates: Rates = {}
    for row in json.loads(out.stdout):
        kind = "pp" if row.get("n_prompt", 0) > 0 else "tg"
        rates[kind] = float(row["avg_ts"])
    return rates


def mlxcel_bench(
    model: str | None,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    *,
    threads: int | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """One `mlxcel bench --json` process: its JSON report ({"model": ..., "results": ...})."""
    cmd = [MLXCEL, "bench", "-p", str(n_prompt), "-n", str(n_gen), "-r", str(repetitions)]
    cmd.append("--json")
    if model:
        cmd += ["-m", model]
    if threads is not None:
        cmd += ["-t", str(threads)]
    out = subprocess.run(
        cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        raise SystemExit(f"mlxcel bench failed: {out.stderr.strip().splitlines()[-1:]}")
    report: dict = json.loads(out.stdout)
    return report


def rates_of(report: dict) -> Rates:
    """{"pp": tok/s, "tg": tok/s} of an `mlxcel bench --json` report (batch 1)."""
    return {r["kind"]: r["tokens_per_second"] for r in report["results"] if r["batch"] == 1}


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("" where it does not)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
