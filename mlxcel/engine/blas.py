"""Use a real BLAS under MLX's CPU backend on Linux.

The `mlx[cpu]` wheel links the reference (netlib) BLAS, which is many times slower than an
optimized one. When a system OpenBLAS is installed (Debian/Ubuntu: `libopenblas0`), loading
it with RTLD_GLOBAL *before* `mlx.core` puts its `cblas_*`/`sgemm_` symbols first in the
global lookup scope, so MLX's float32 matmuls run on it (measured here: a 512x512 matmul
24x faster, MiniLM embeddings 13x). `MLXCEL_BLAS` controls it: `auto` (default: use OpenBLAS
when found), `off`, or a path to a BLAS shared library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

BLAS_ENV = "MLXCEL_BLAS"
_CANDIDATES = ("openblas", "openblasp", "openblas64_")
_state: dict[str, str] = {}


def _find() -> str | None:
    for name in _CANDIDATES:
        path = ctypes.util.find_library(name)
        if path:
            return path
    return None


def use_system_blas() -> str:
    """Load the chosen BLAS globally (once); return a short description of what MLX uses."""
    if "blas" in _state:
        return _state["blas"]
    choice = os.environ.get(BLAS_ENV, "auto").strip() or "auto"
    description = "bundled reference BLAS" if sys.platform == "linux" else "platform BLAS"
    if sys.platform == "linux" and choice.lower() not in ("off", "none", "0", "false"):
        if "mlx.core" in sys.modules:
            description += " (mlx was imported before mlxcel could load OpenBLAS)"
        else:
            path = _find() if choice.lower() == "auto" else choice
            if path and (os.cpu_count() or 1) <= 4:
                # On small machines OpenBLAS's spinning worker threads fight MLX's own for
                # the cores: one thread gave +59% decode at 8 streams on 2 cores.
                os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            if path:
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    description = f"OpenBLAS ({path})" if "openblas" in path else path
                except OSError:
                    description += f" ({path} could not be loaded)"
    _state["blas"] = description
    return description


def blas_in_use() -> str:
    """What `use_system_blas` decided (it runs when `mlxcel.engine` is imported)."""
    return use_system_blas()
