"""The CPU path loads a system OpenBLAS for MLX when there is one (MLXCEL_BLAS)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys

import pytest

PROBE = "import mlxcel.engine; from mlxcel.engine.blas import blas_in_use; print(blas_in_use())"


def probe(value: str | None, code: str = PROBE) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_BLAS"}
    if value is not None:
        env["MLXCEL_BLAS"] = value
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    return out.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="only MLX's Linux CPU wheel bundles netlib")
def test_off_keeps_the_bundled_blas() -> None:
    assert probe("off") == "bundled reference BLAS"


@pytest.mark.skipif(
    sys.platform != "linux" or ctypes.util.find_library("openblas") is None,
    reason="no system OpenBLAS on this machine (apt-get install libopenblas0)",
)
def test_auto_loads_openblas_and_matmul_still_correct() -> None:
    assert probe(None).startswith("OpenBLAS")
    check = (
        "import mlxcel.engine, mlx.core as mx, numpy as np\n"
        "a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / 4096\n"
        "got = np.array(mx.array(a) @ mx.array(a))\n"
        "print(float(np.abs(got - a @ a).max()))"
    )
    assert float(probe(None, check)) < 1e-3


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_too_late_when_mlx_came_first() -> None:
    code = "import mlx.core; " + PROBE
    assert "imported before" in probe(None, code)
