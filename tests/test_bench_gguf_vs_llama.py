"""bench/gguf_vs_llama.py: mlxcel against llama-bench on one GGUF (no timings asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gguf_vs_llama.py"

# Stands in for llama-bench: checks the arguments it is given and prints llama-bench's JSON.
FAKE_LLAMA_BENCH = """#!/bin/sh
echo "$@" >> "$0.args"
cat <<'JSON'
[{"n_prompt": 8, "n_gen": 0, "avg_ts": 100.0}, {"n_prompt": 0, "n_gen": 2, "avg_ts": 10.0}]
JSON
"""


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny_models import write_tiny_gguf

    return write_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("g") / "tiny.Q8_0.gguf", "Q8_0")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_BENCH"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_without_llama_bench_it_prints_mlxcels_figures_and_says_so(tiny_gguf: Path) -> None:
    out = _run("-m", str(tiny_gguf), "-p", "8", "-n", "2", "-r", "1", "--rounds", "1")
    assert out.returncode == 0, out.stderr
    assert "llama-bench: absent" in out.stdout
    assert re.search(r"^\s+1 mlxcel\s+[\d.]+\s+[\d.]+$", out.stdout, re.M), out.stdout
    assert "ratio" not in out.stdout and "CPU: " in out.stdout
    assert "mlxcel ran it as: llama Q8_0" in out.stdout


def test_with_llama_bench_both_run_alike_and_ratios_are_printed(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    args = ("-m", str(tiny_gguf), "-p", "8", "-n", "2", "-r", "1", "--rounds", "2", "-t", "2")
    out = _run(*args, "--llama-bench", str(fake))
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "llama-bench.args").read_text().splitlines()
    assert calls == [f"-m {tiny_gguf} -p 8 -n 2 -r 1 -t 2 -o json"] * 2
    rows = re.findall(r"^\s+(\d) (mlxcel|llama\.cpp)\s", out.stdout, re.M)
    assert rows == [("1", "llama.cpp"), ("1", "mlxcel"), ("2", "mlxcel"), ("2", "llama.cpp")]
    for round_ in ("1", "2"):
        pp, tg = re.search(
            rf"^\s+{round_} mlxcel\s+([\d.]+)\s+([\d.]+)$", out.stdout, re.M
        ).groups()  # type: ignore[union-attr]
        ratio = re.search(rf"^\s+{round_} ratio\s+([\d.]+)x\s+([\d.]+)x$", out.stdout, re.M)
        assert ratio is not None
        assert float(ratio.group(1)) == pytest.approx(float(pp) / 100, abs=0.01)
        assert float(ratio.group(2)) == pytest.approx(float(tg) / 10, abs=0.01)
    assert re.search(r"^pp: median [\d.]+x \(rounds", out.stdout, re.M)
    assert re.search(r"^tg: median [\d.]+x .*target >= 0\.8x", out.stdout, re.M)
