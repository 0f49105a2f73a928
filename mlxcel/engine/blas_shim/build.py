"""Build and load the shim that puts the PyPI OpenBLAS (scipy-openblas32) under MLX.

The `scipy-openblas32` wheel ships a full OpenBLAS whose symbols all carry a `scipy_`
prefix (`scipy_cblas_sgemm`), so it cannot stand in for the reference BLAS that MLX's
CPU backend calls by the plain names. `forward.c` defines those plain names as tail jumps
to the prefixed ones; it is compiled once on this machine with the system C compiler and
cached next to the CPU kernel (`$MLXCEL_KERNEL_DIR`, default
`~/.cache/mlxcel/kernels/blas-shim-<key>/`), keyed by the shim source, the wheel's
library, the compiler and the machine. `scripts/setup.sh` builds it at install time
(`python -m mlxcel.engine.blas_shim`), else the first `import mlxcel.engine` does
(well under a second). Nothing here imports MLX: it must run before `mlx.core` is loaded.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mlxcel.config import process_env

WHEEL = "scipy-openblas32"
PACKAGE = "scipy_openblas32"
PREFIX = "scipy_"
SOURCE = Path(__file__).with_name("forward.c")
SHIM_NAME = "libmlxcel_blas_shim.so"
_FLAGS = ("-shared", "-fPIC", "-O2")
_SUPPORTED = ("x86_64", "AMD64", "aarch64", "arm64")


class ShimError(RuntimeError):
    """The PyPI OpenBLAS or its shim is missing, cannot be built, or cannot be loaded."""


def wheel_library() -> Path | None:
    """The OpenBLAS shared library inside the installed scipy-openblas32 wheel, if any.

    Found without importing the package (its import loads the library as a side effect)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    if not lib_dir.is_dir():
        return None
    found = sorted(p for p in lib_dir.iterdir() if p.name.startswith("libscipy_openblas"))
    libs = [p for p in found if ".so" in p.name]
    return libs[0] if libs else None


def wheel_version() -> str:
    """The installed scipy-openblas32 version ("" when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(WHEEL)
    except PackageNotFoundError:
        return ""


def _compiler() -> str | None:
    """`$CC` when set (and only it), else the first C-capable compiler on PATH."""
    chosen = os.environ.get("CC")
    for candidate in [chosen] if chosen else ["cc", "gcc", "clang", "c++", "g++", "clang++"]:
        if shutil.which(candidate):
            return candidate
    return None


def build_key(library: Path) -> str:
    """What the shim depends on, hashed (16 hex digits)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    stat = library.stat()
    for part in (
        " ".join(_FLAGS),
        str(library.resolve()),
        str(stat.st_size),
        str(int(stat.st_mtime)),
        wheel_version(),
        platform.machine(),
        _compiler() or "",
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def shim_path(library: Path) -> Path:
    """Where the shim for this OpenBLAS and compiler is cached."""
    return process_env.kernel_cache_dir() / f"blas-shim-{build_key(library)}" / SHIM_NAME


def build(library: Path) -> Path:
    """Compile the shim against `library` (once per key; concurrent callers wait on a lock)."""
    if sys.platform != "linux" or platform.machine() not in _SUPPORTED:
        raise ShimError("the BLAS shim is built on Linux x86_64/aarch64 only, not here")
    target = shim_path(library)
    if target.is_file():
        return target
    compiler = _compiler()
    if compiler is None:
        raise ShimError("no C compiler found (install gcc or clang, or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        lib_dir = library.parent
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / target.name
            language = ["-x", "c"] if "++" in Path(compiler).name else []
            cmd = [
                compiler,
                *_FLAGS,
                *language,
                str(SOURCE),
                "-o",
                str(partial),
                f"-L{lib_dir}",
                f"-l:{library.name}",
                f"-Wl,-rpath,{lib_dir}",
            ]
            done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise ShimError(f"compiling the BLAS shim failed: {_first_error(done.stderr)}")
            os.replace(partial, target)
    return target


def _first_error(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or ["unknown error"])[0]


def load(threads: int | None = None) -> str:
    """Load the wheel's OpenBLAS and the shim with RTLD_GLOBAL (building the shim when
    needed); return a description. `threads` sets OpenBLAS's thread count. Raises
    ShimError when the wheel is missing or the shim cannot be built or loaded."""
    library = wheel_library()
    if library is None:
        raise ShimError(f"{WHEEL} is not installed (pip install {WHEEL})")
    path = shim_path(library)
    if not path.is_file():
        path = build(library)
    try:
        openblas = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise ShimError(f"loading the BLAS shim failed: {exc}") from exc
    if threads is not None and threads > 0:
        openblas[f"{PREFIX}openblas_set_num_threads"](ctypes.c_int(threads))
    return f"OpenBLAS (PyPI {WHEEL} {wheel_version()}, mlxcel shim)"


def main() -> int:
    """`python -m mlxcel.engine.blas_shim`: build the shim now and say where it went."""
    library = wheel_library()
    if library is None:
        print(f"mlxcel BLAS shim: not built: {WHEEL} is not installed", file=sys.stderr)
        return 1
    try:
        path = build(library)
    except ShimError as exc:
        print(f"mlxcel BLAS shim: not built: {exc}", file=sys.stderr)
        return 1
    print(f"mlxcel BLAS shim: {path} (forwards to {library.name})")
    return 0
