"""Times the event-loop callbacks of the process it is loaded into: a bench's server, given
this directory on PYTHONPATH and a file in $MLXCEL_LOOP_PROBE. Each callback that took over
1 ms of wall or thread CPU time is appended to that file as
`unix_time wall_ms cpu_ms runqueue_ms`.

CPU time is the loop's own work; `runqueue_ms` is how long the loop thread was ready to run
but waited for a CPU (Linux /proc/thread-self/schedstat; 0 where there is none); the rest
of the wall time it waited for the GIL. Only for bench/ (vision_concurrency.py); nothing in
mlxcel loads it.
"""

from __future__ import annotations

import asyncio.events
import os
import time

_SCHEDSTAT = "/proc/thread-self/schedstat"


def _runqueue_ns() -> int:
    """Nanoseconds this thread has waited for a CPU while ready to run (0: unknown)."""
    try:
        with open(_SCHEDSTAT) as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


_path = os.environ.get("MLXCEL_LOOP_PROBE")
if _path:
    _out = open(_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    _run = asyncio.events.Handle._run

    def _timed(self: asyncio.events.Handle) -> None:
        wall, cpu, queued = time.perf_counter(), time.thread_time(), _runqueue_ns()
        try:
            _run(self)
        finally:
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            if wall > 0.001 or cpu > 0.001:
                waited = (_runqueue_ns() - queued) / 1e6
                _out.write(f"{time.time():.6f} {wall * 1000:.3f} {cpu * 1000:.3f} {waited:.3f}\n")

    asyncio.events.Handle._run = _timed  # type: ignore[method-assign]
