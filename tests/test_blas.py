"""The CPU path loads a real BLAS under MLX (MLXCEL_BLAS): a system OpenBLAS when there is
one, else the PyPI OpenBLAS (scipy-openblas32) through mlxcel's shim; the reference BLAS
only as a fallback, with one line saying so."""

from __future__ import annotations

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcel.engine.blas import short_name
from mlxcel.engine.blas_shim.build import SOURCE, wheel_library

PROBE = "import mlxcel.engine; from mlxcel.engine.blas import blas_in_use; print(blas_in_use())"
LINUX = pytest.mark.skipif(sys.platform != "linux", reason="MLX's Linux CPU wheel only")
HAS_WHEEL = wheel_library() is not None
HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang", "c++", "g++", "clang++"))
PYPI = pytest.mark.skipif(
    sys.platform != "linux" or not HAS_WHEEL or not HAS_CC,
    reason="needs Linux, the scipy-openblas32 wheel and a C compiler",
)
# numpy compares against its own BLAS; MLX's results must agree to float32 rounding.
NUMERICS = """
import mlxcel.engine, mlx.core as mx, numpy as np
from mlxcel.engine.blas import blas_in_use
rng = np.random.default_rng(0)
worst = 0.0
for m, k, n in ((1, 64, 96), (7, 300, 129), (256, 512, 384)):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
    got_t = np.array(mx.array(np.ascontiguousarray(a.T)).T @ mx.array(np.ascontiguousarray(b.T)).T)
    worst = max(worst, float(np.abs(got_t - ref).max() / np.abs(ref).max()))
s = rng.standard_normal((48, 32)).astype(np.float32)
sv = np.array(mx.linalg.svd(mx.array(s), compute_uv=False, stream=mx.cpu))
sv_err = float(np.abs(np.sort(sv)[::-1] - np.linalg.svd(s, compute_uv=False)).max())
spd = (s.T @ s + 32 * np.eye(32)).astype(np.float32)
inv = np.array(mx.linalg.inv(mx.array(spd), stream=mx.cpu))
inv_err = float(np.abs(inv @ spd - np.eye(32)).max())
chol = np.array(mx.linalg.cholesky(mx.array(spd), stream=mx.cpu))
chol_err = float(np.abs(chol @ chol.T - spd).max() / np.abs(spd).max())
print(blas_in_use()); print(worst, sv_err, inv_err, chol_err)
"""


def probe(
    value: str | None, code: str = PROBE, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_BLAS"}
    if value is not None:
        env["MLXCEL_BLAS"] = value
    env.update(extra or {})
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )


@LINUX
def test_off_keeps_the_bundled_blas_and_says_nothing() -> None:
    done = probe("off")
    assert done.stdout.strip() == "bundled reference BLAS"
    assert done.stderr == ""


@PYPI
def test_pypi_openblas_runs_under_mlx_with_numpy_numerics(tmp_path: Path) -> None:
    # A fresh cache: the shim is built here, by the first import that needs it.
    done = probe("pypi", NUMERICS, {"MLXCEL_KERNEL_DIR": str(tmp_path)})
    description, figures = done.stdout.strip().splitlines()
    assert description.startswith("OpenBLAS (PyPI scipy-openblas32 ")
    assert short_name(description) == "OpenBLAS/PyPI"
    matmul, svd, inv, chol = map(float, figures.split())
    assert matmul < 1e-5  # relative to the largest entry, vs a float64 product
    assert svd < 1e-4 and inv < 1e-4 and chol < 1e-5
    assert list(tmp_path.glob("blas-shim-*/libmlxcel_blas_shim.so"))
    assert done.stderr == ""


@PYPI
def test_mlx_binds_its_blas_calls_to_the_shim(tmp_path: Path) -> None:
    # The dynamic linker's own record: libmlx's cblas_sgemm and sgesdd_ resolve to the
    # shim, not to the reference BLAS the wheel bundles (which is still loaded).
    code = "import mlxcel.engine, mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))"
    done = probe("pypi", code, {"LD_DEBUG": "bindings", "MLXCEL_KERNEL_DIR": str(tmp_path)})
    bindings = [line for line in done.stderr.splitlines() if "libmlx.so" in line]
    for symbol in ("cblas_sgemm", "sgesdd_"):
        bound = [line for line in bindings if f"`{symbol}'" in line]
        assert bound and all("libmlxcel_blas_shim" in line for line in bound), symbol


@PYPI
def test_auto_prefers_a_system_openblas_else_the_pypi_one(tmp_path: Path) -> None:
    described = probe(None, extra={"MLXCEL_KERNEL_DIR": str(tmp_path)}).stdout.strip()
    if ctypes.util.find_library("openblas"):
        assert described.startswith("OpenBLAS (system, ")
    else:
        assert short_name(described) == "OpenBLAS/PyPI"


@PYPI
def test_no_compiler_falls_back_with_one_warning(tmp_path: Path) -> None:
    done = probe("pypi", extra={"MLXCEL_KERNEL_DIR": str(tmp_path), "CC": "/nonexistent/cc"})
    assert done.stdout.strip() == "bundled reference BLAS"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "PyPI OpenBLAS is not used" in lines[0] and "no C compiler" in lines[0]


@LINUX
def test_no_fast_blas_at_all_prints_the_hint_once() -> None:
    # Hide the wheel (and a system OpenBLAS) from this process: one line says how to fix it.
    code = (
        "import sys, ctypes.util; sys.modules['scipy_openblas32'] = None\n"
        "ctypes.util.find_library = lambda name: None\n" + PROBE
    )
    done = probe(None, code)
    assert done.stdout.strip() == "bundled reference BLAS"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install scipy-openblas32" in lines[0]


@pytest.mark.skipif(
    sys.platform != "linux" or ctypes.util.find_library("openblas") is None,
    reason="no system OpenBLAS on this machine (apt-get install libopenblas0)",
)
def test_system_openblas_is_loaded_and_matmul_still_correct() -> None:
    done = probe("system", NUMERICS)
    description, figures = done.stdout.strip().splitlines()
    assert description.startswith("OpenBLAS (system, ")
    assert float(figures.split()[0]) < 1e-5


@LINUX
def test_too_late_when_mlx_came_first() -> None:
    assert "imported before" in probe(None, "import mlx.core; " + PROBE).stdout


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("nm") is None, reason="needs Linux and nm"
)
def test_the_shim_forwards_every_blas_symbol_mlx_imports() -> None:
    import mlx

    libmlx = Path(mlx.__path__[0]) / "lib" / "libmlx.so"
    out = subprocess.run(
        ["nm", "-D", "--undefined-only", str(libmlx)], capture_output=True, text=True, check=True
    ).stdout
    imported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    wanted = {s for s in imported if s.startswith("cblas_") or re.fullmatch(r"[sdcz][a-z]+_", s)}
    forwarded = set(re.findall(r"MLXCEL_FORWARD\((\w+)\)", SOURCE.read_text()))
    assert wanted and wanted <= forwarded, sorted(wanted - forwarded)


def test_short_names() -> None:
    assert short_name("bundled reference BLAS (x)") == "reference BLAS"
    assert short_name("OpenBLAS (system, libopenblas.so.0)") == "OpenBLAS/system"
    assert short_name("/opt/lib/libblis.so") == "libblis.so"
    assert short_name("platform BLAS") == "platform BLAS"
