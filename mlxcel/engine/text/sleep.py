"""Sleeping on idle (`--sleep-idle-seconds`): the text engine frees its model after a quiet
spell and loads it again for the next request that needs it.

`IdleSleep` is the state the engine keeps under its lock: when the last request finished,
whether the engine sleeps, and who waits for it to wake. The engine thread does both
transitions itself, so MLX work stays on the thread that owns the model:

- asleep: no request queued or running for `seconds` since the last one finished (a
  streaming request holds its slot, so it is never idle); the engine drops the network,
  its batch generator (the KV caches), the draft model and the prompt cache, then asks MLX
  to return its buffer cache; the tokenizer and the model's facts stay, they are small and
  `/props` reports them while asleep;
- awake: a request is queued, or someone called `TextEngine.wake()`; the engine runs
  `reload` (supplied by whoever built it: the server reloads from its settings) before
  it admits anything, so every request that arrived meanwhile waits for that one reload.

One line is logged on each transition, with the process's resident memory and MLX's
active memory before and after (`memory_now`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from mlxcel.engine.text.speculative import SpeculationConfig


@dataclass(frozen=True)
class Reloaded:
    """What waking up loads again: the network and, with speculation, its config."""

    model: Any  # an mlx-lm style nn.Module
    speculation: SpeculationConfig | None = None


Reloader = Callable[[], Reloaded]


class IdleSleep:
    """The sleep state of one engine. Every method runs under the engine's lock."""

    def __init__(
        self, seconds: float, reload: Reloader, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if seconds <= 0:
            raise ValueError("sleep_idle_seconds must be positive")
        self.seconds = float(seconds)
        self.reload = reload
        self._clock = clock
        self.asleep = False
        self.wake_asked = False
        self.last_active = clock()
        self._waiters: list[Future[None]] = []

    def touch(self) -> None:
        """A request arrived or finished: the idle clock starts again."""
        self.last_active = self._clock()

    def seconds_left(self) -> float:
        """Seconds until the engine may sleep (<= 0: it may sleep now)."""
        return self.last_active + self.seconds - self._clock()

    def ask_wake(self) -> Future[None]:
        """A future resolved once the engine is awake (at once when it already is)."""
        future: Future[None] = Future()
        if not self.asleep:
            future.set_result(None)
            return future
        self.wake_asked = True
        self._waiters.append(future)
        return future

    def fell_asleep(self) -> None:
        self.asleep = True
        self.wake_asked = False

    def woke(self, error: BaseException | None = None) -> list[Future[None]]:
        """Leave sleep (or, with `error`, stay asleep); the waiters to resolve, outside the lock."""
        waiters, self._waiters = self._waiters, []
        self.wake_asked = False
        if error is None:
            self.asleep = False
            self.touch()
        return waiters


def resolve(waiters: list[Future[None]], error: BaseException | None = None) -> None:
    """Tell everyone waiting for a wake-up how it went."""
    for future in waiters:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


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
