"""The process's memory: its resident size and MLX's active memory (`memory_now`), and
handing freed memory back to the system (`release_memory`) after a model is loaded or
dropped."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryUse:
    """Resident memory of the process and MLX's active memory, in bytes (-1: unknown)."""

    rss: int
    mlx_active: int

    def mib(self) -> str:
        def show(n: int) -> str:
            return f"{n / 2**20:.0f} MiB" if n >= 0 else "?"

        return f"RSS {show(self.rss)}, MLX {show(self.mlx_active)}"


def resident_bytes() -> int:
    """The process's resident set size now (Linux /proc; macOS task_info), -1 if unknown."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "darwin":
        return _darwin_resident_bytes()
    return -1


def _darwin_resident_bytes() -> int:
    import ctypes

    class _BasicInfo(ctypes.Structure):  # mach_task_basic_info
        _fields_ = [
            ("virtual_size", ctypes.c_uint64),
            ("resident_size", ctypes.c_uint64),
            ("resident_size_max", ctypes.c_uint64),
            ("user_time", ctypes.c_uint64),
            ("system_time", ctypes.c_uint64),
            ("policy", ctypes.c_int),
            ("suspend_count", ctypes.c_int),
        ]

    try:
        libc = ctypes.CDLL(None)
        info = _BasicInfo()
        count = ctypes.c_uint(ctypes.sizeof(info) // 4)
        task = ctypes.c_uint.in_dll(libc, "mach_task_self_")
        flavor = 20  # MACH_TASK_BASIC_INFO
        if libc.task_info(task, flavor, ctypes.byref(info), ctypes.byref(count)) != 0:
            return -1
        return int(info.resident_size)
    except (OSError, AttributeError, ValueError):
        return -1


def memory_now() -> MemoryUse:
    """What the process holds now, for the sleep and wake log lines."""
    import mlx.core as mx

    try:
        active = int(mx.get_active_memory())
    except (AttributeError, RuntimeError):
        active = -1
    return MemoryUse(resident_bytes(), active)


def release_memory() -> None:
    """Collect the dropped model's arrays and hand MLX's buffer cache back to the system."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    try:  # glibc keeps freed heap pages; give them back so RSS really goes down
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
