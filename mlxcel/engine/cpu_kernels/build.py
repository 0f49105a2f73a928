"""Build and load mlxcel's CPU kernels: a small MLX extension compiled on this machine.

MLX's CPU backend has no fast kernel for quantized matmuls, so mlxcel ships one
(`qmatmul.cpp`, an MLX primitive with AVX-512/AVX2/scalar paths) and compiles it with the
system C++ compiler against the installed `mlx` and `nanobind`, for this CPU
(`-march=native`). The result is cached under `$MLXCEL_KERNEL_DIR` (default
`~/.cache/mlxcel/kernels/<key>/`), keyed by the source, mlx, nanobind, Python and machine, so
an upgrade of any of them rebuilds it. `scripts/setup.sh` builds it at install time
(`python -m mlxcel.engine.cpu_kernels.build`); otherwise the first load that wants it does.

`MLXCEL_CPU_KERNELS=off` disables it (float32 dequantization is used instead).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from mlxcel.config import process_env

log = logging.getLogger(__name__)

MODULE_NAME = "_mlxcel_cpu_kernels"
SOURCE = Path(__file__).with_name("qmatmul.cpp")

# mlx.core is built with NB_DOMAIN=mlx: sharing it lets the module take and return mx.array.
_FLAGS = ("-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx", "-w")

_state: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or imported on this machine."""


def _compiler() -> str | None:
    """`$CXX` when set (and only it), else the first of c++, g++, clang++ on PATH."""
    chosen = os.environ.get("CXX")
    for candidate in [chosen] if chosen else ["c++", "g++", "clang++"]:
        if shutil.which(candidate):
            return candidate
    return None


def build_key() -> str:
    """What the compiled module depends on, hashed (16 hex digits)."""
    from importlib.metadata import version

    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (
        " ".join(_FLAGS),
        process_env.kernel_cflags(),
        version("mlx"),
        version("nanobind"),
        sys.version,
        platform.machine(),
        platform.system(),
        _compiler() or "",
        _cpu_flags(),
    ):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:
        pass
    return ""


def module_path() -> Path:
    """Where the compiled module for the current key lives."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return process_env.kernel_cache_dir() / build_key() / f"{MODULE_NAME}{suffix}"


def build() -> Path:
    """Compile the kernel module (once per key; concurrent callers wait on a lock)."""
    import mlx
    import nanobind

    target = module_path()
    if target.is_file():
        return target
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (install g++ or clang++, or set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        mlx_dir = Path(mlx.__path__[0])
        nb_dir = Path(nanobind.__file__).parent
        includes = [
            mlx_dir / "include",
            Path(nanobind.include_dir()),
            nb_dir / "ext" / "robin_map" / "include",
            Path(sysconfig.get_paths()["include"]),
        ]
        flags = [*_FLAGS, *(f"-I{path}" for path in includes)]
        if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64"):
            flags.append("-march=native")
        flags += process_env.kernel_cflags().split()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = []
            jobs = []
            units = [
                (SOURCE, "-O3"),
                (Path(nanobind.source_dir()) / "nb_combined.cpp", "-Os"),
            ]
            for index, (source, opt) in enumerate(units):
                obj = Path(tmp) / f"unit{index}.o"
                objects.append(obj)
                cmd = [compiler, *flags, opt, "-c", str(source), "-o", str(obj)]
                jobs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
            errors = [job.communicate()[1] for job in jobs]
            failed = [err for job, err in zip(jobs, errors, strict=True) if job.returncode != 0]
            if failed:
                raise KernelBuildError(f"compiling the CPU kernel failed: {_tail(failed[0])}")
            partial = Path(tmp) / target.name
            link = [
                compiler,
                "-shared",
                *map(str, objects),
                "-o",
                str(partial),
                f"-L{mlx_dir / 'lib'}",
                "-lmlx",
                f"-Wl,-rpath,{mlx_dir / 'lib'}",
            ]
            done = subprocess.run(link, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise KernelBuildError(f"linking the CPU kernel failed: {_tail(done.stderr)}")
            os.replace(partial, target)
    return target


def _tail(text: str) -> str:
    """The compiler's first error line (else its last line)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or ["unknown error"])[0]


def load_kernels() -> ModuleType | None:
    """The kernel module, building it when needed; None (reason in `kernel_status`) when
    it is turned off or cannot be built or imported here."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    module: ModuleType | None = None
    if not process_env.cpu_kernels_enabled():
        _state["reason"] = f"off ({process_env.CPU_KERNELS})"
    else:
        try:
            path = module_path()
            if not path.is_file():
                log.warning("building the CPU kernel for this machine (once, about 10-30 s)")
                path = build()
            module = _import(path)
            _self_test(module)
            module.set_threads(default_threads())
        except (KernelBuildError, ImportError, OSError, TypeError, ValueError) as exc:
            _state["reason"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("mlxcel CPU kernels unavailable: %s", _state["reason"])
    _state["module"] = module
    return module


def _self_test(module: ModuleType) -> None:
    """Run the kernel once against MLX's own dequantize: catches a nanobind ABI mismatch
    with mlx (a TypeError on the first call) or a miscompiled kernel before a model uses it.
    The float path must match closely; the int8 path (x rounded to 8 bits) within 2% of the
    largest output."""
    import mlx.core as mx

    for int8 in (False, True):
        module.set_int8(int8)
        for bits in (4, 8):
            w = mx.arange(64 * 64, dtype=mx.float32).reshape(64, 64) % 13 - 6
            x = mx.arange(3 * 64, dtype=mx.float32).reshape(3, 64) % 7 - 3
            packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            expected = x @ mx.dequantize(packed, scales, biases, group_size=32, bits=bits).T
            got = module.quantized_matmul(x, packed, scales, biases, 32, bits)
            if int8 and bits == 4:
                worst = mx.abs(got - expected).max() / mx.abs(expected).max()
                ok = bool((worst < 2e-2).item())
            else:
                ok = bool(mx.allclose(got, expected, rtol=1e-4, atol=1e-3).item())
            if not ok:
                raise ValueError(f"self-test failed ({bits}-bit results differ from mlx)")
    module.set_int8(process_env.kernel_int8_enabled())


def default_threads() -> int:
    """Kernel threads unless `-t/--threads` says otherwise: one per core, at most 8. Matmuls
    under about 4M multiply-adds run on MLX's own thread anyway, so the pool only helps
    where there is work to split (measured on 2 cores: batch-8 decode +20-30%, one
    sequence unchanged)."""
    return max(1, min(8, os.cpu_count() or 1))


def _import(path: Path) -> ModuleType:
    import mlx.core  # noqa: F401  (the extension needs mlx's nanobind types registered)

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_status() -> str:
    """A short description for `/props` and `mlxcel bench`."""
    module = _state.get("module")
    if module is not None:
        simd = module.simd  # type: ignore[attr-defined]
        if simd == "scalar":
            return "mlxcel CPU kernels (scalar: not used, float32 weights are faster here)"
        threads = module.threads()  # type: ignore[attr-defined]
        if module.int8():  # type: ignore[attr-defined]
            int8 = module.int8_simd  # type: ignore[attr-defined]
            return f"mlxcel CPU kernels ({simd}, int8 {int8}, {threads} threads)"
        return f"mlxcel CPU kernels ({simd}, {threads} threads)"
    if "reason" in _state:
        return f"mlxcel CPU kernels unavailable: {_state['reason']}"
    return "mlxcel CPU kernels not used (no quantized weights loaded on the CPU)"


def main() -> int:
    """`python -m mlxcel.engine.cpu_kernels.build`: build now and say where it went."""
    import mlxcel.engine  # noqa: F401  (loads the BLAS before mlx.core)

    if not process_env.cpu_kernels_enabled():
        print(f"mlxcel CPU kernels: off ({process_env.CPU_KERNELS})")
        return 0
    try:
        path = build()
        _import(path)
    except (KernelBuildError, ImportError, OSError) as exc:
        print(f"mlxcel CPU kernels: not built: {exc}", file=sys.stderr)
        return 1
    print(f"mlxcel CPU kernels: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
