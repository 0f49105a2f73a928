"""Use a real BLAS under MLX's CPU backend on Linux.

The `mlx[cpu]` wheel links the reference (netlib) BLAS, which is many times slower than an
optimized one. Loading an OpenBLAS with RTLD_GLOBAL *before* `mlx.core` puts its plain
`cblas_*`/LAPACK symbols first in the global lookup scope, so MLX's float32 matmuls run on
it (measured here: a 512x512 matmul about 20x faster, MiniLM embeddings 13x). Two sources:

- a system OpenBLAS (Debian/Ubuntu: `libopenblas0`), loaded as it is;
- the OpenBLAS of the `scipy-openblas32` PyPI wheel (a dependency of mlxcel on Linux),
  whose symbols are prefixed: `mlxcel.engine.blas_shim` builds and loads a tiny shim that
  forwards the plain names to it.

`MLXCEL_BLAS` chooses: `auto` (default: the system OpenBLAS when there is one, else the
PyPI one), `system`, `pypi`, `off`, or a path to a BLAS shared library. When MLX ends up on
the reference BLAS anyway, one line on stderr says how to get the fast one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

from mlxcel.config import process_env

log = logging.getLogger(__name__)

REFERENCE = "bundled reference BLAS"
_CANDIDATES = ("openblas", "openblasp", "openblas64_")
_OFF = ("off", "none", "0", "false")
HINT = (
    "mlxcel: MLX's CPU matmuls run on the slow reference BLAS here; "
    "`pip install scipy-openblas32` (with a C compiler) or `apt-get install libopenblas0` "
    "makes them many times faster (see docs/cpu.md)"
)
_state: dict[str, str] = {}


def _find() -> str | None:
    for name in _CANDIDATES:
        path = ctypes.util.find_library(name)
        if path:
            return path
    return None


def _threads() -> int | None:
    """OpenBLAS threads: one on machines with 4 cores or fewer (its spinning worker threads
    fight MLX's own: one thread gave +59% decode at 8 streams on 2 cores), else its default.
    `OPENBLAS_NUM_THREADS` wins when set."""
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return None
    return 1 if (os.cpu_count() or 1) <= 4 else None


def _load_system(path: str) -> str:
    threads = _threads()
    if threads is not None:
        os.environ["OPENBLAS_NUM_THREADS"] = str(threads)
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return f"{REFERENCE} ({path} could not be loaded)"
    return f"OpenBLAS (system, {path})" if "openblas" in path else path


def _load_pypi() -> str:
    """The PyPI OpenBLAS through the shim; raises ShimError when it cannot be used."""
    from mlxcel.engine.blas_shim.build import load

    return load(threads=_threads())


def _choose(choice: str) -> str:
    """Load what `choice` asks for; return the description (warnings logged here)."""
    from mlxcel.engine.blas_shim.build import ShimError, wheel_library

    lowered = choice.lower()
    if lowered in ("auto", "system"):
        path = _find()
        if path:
            return _load_system(path)
        if lowered == "system":
            log.warning("mlxcel: %s=system but no system OpenBLAS was found", process_env.BLAS)
            return REFERENCE
    if lowered in ("auto", "pypi"):
        try:
            return _load_pypi()
        except ShimError as exc:
            if wheel_library() is None and lowered == "auto":
                log.warning(HINT)  # nothing to fall back on: say how to get it
            else:
                log.warning(
                    "mlxcel: the PyPI OpenBLAS is not used (%s); MLX's CPU matmuls "
                    "run on the slow reference BLAS",
                    exc,
                )
            return REFERENCE
    return _load_system(choice)


def use_system_blas() -> str:
    """Load the chosen BLAS globally (once); return a short description of what MLX uses."""
    if "blas" in _state:
        return _state["blas"]
    choice = process_env.blas_choice()
    if sys.platform != "linux":
        description = "platform BLAS"
    elif choice.lower() in _OFF:
        description = REFERENCE
    elif "mlx.core" in sys.modules:
        description = f"{REFERENCE} (mlx was imported before mlxcel could load OpenBLAS)"
    else:
        description = _choose(choice)
    _state["blas"] = description
    return description


def blas_in_use() -> str:
    """What `use_system_blas` decided (it runs when `mlxcel.engine` is imported)."""
    return use_system_blas()


def is_reference(description: str) -> bool:
    """True when `description` (from `blas_in_use`) is MLX's bundled reference BLAS."""
    return description.startswith(REFERENCE)


def short_name(description: str) -> str:
    """A column-sized name for a `blas_in_use` description: `OpenBLAS/PyPI`,
    `OpenBLAS/system`, `reference BLAS`, `platform BLAS` or the library's file name."""
    if is_reference(description):
        return "reference BLAS"
    if description.startswith("OpenBLAS (PyPI"):
        return "OpenBLAS/PyPI"
    if description.startswith("OpenBLAS (system"):
        return "OpenBLAS/system"
    if description == "platform BLAS" or not description:
        return description
    return os.path.basename(description.split(" (")[0])
