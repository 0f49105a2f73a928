"""Measures the event loop of the process it is loaded into: a bench's server, given this
directory on PYTHONPATH. Only for bench/ (vision_concurrency.py, media_event_loop.py);
nothing in mlxcel loads it.

- `$MLXCEL_LOOP_PROBE` (a file): each event-loop callback that took over 1 ms of wall or
  thread CPU time is appended as `unix_time wall_ms cpu_ms runqueue_ms`. CPU time is the
  loop's own work; `runqueue_ms` is how long the loop thread was ready to run but waited
  for a CPU (Linux /proc/thread-self/schedstat; 0 where there is none); the rest of the
  wall time it waited for the GIL.
- `$MLXCEL_LOOP_LAG` (a file): a ticker on the loop asks to run every `TICK` seconds
  (`call_later`) and appends, once a second, `unix_time ticks lag_max_ms runqueue_ms
  over_5ms rest_max_ms` for the ticks of that second: how late the latest one ran after
  its due time (the loop's lag, as any callback it runs sees it), what the loop thread
  waited for a CPU over that tick, how many ticks were over 5 ms late, and the most any
  tick was late beyond its wait for a CPU (waiting for the GIL, or the loop's own work).
  This is the server's own lag, without the HTTP client's.
- `$MLXCEL_LOOP_DUMP` (a file, with `$MLXCEL_LOOP_LAG`): when a tick runs over
  `DUMP_AFTER` seconds late, the other threads' stacks as they are then are written
  there: a thread that held the GIL in one long call has just returned from it, so where
  it stands tells what held the loop up (faulthandler's watchdog, which needs no GIL,
  crashes a busy server).
"""

from __future__ import annotations

import asyncio.base_events
import asyncio.events
import os
import sys
import threading
import time
import traceback

_SCHEDSTAT = "/proc/thread-self/schedstat"
TICK = 0.001
DUMP_AFTER = 0.004


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


class _LagTicker:
    """A `TICK` ticker on one loop that logs each second's worst lag."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out: object, dump: object) -> None:
        self.loop, self.out, self.dump = loop, out, dump
        self.second = int(time.time())
        self.ticks, self.over = 0, 0
        self.worst = self.worst_queued = self.worst_rest = 0.0
        self.due, self.queued = 0.0, 0
        self._arm()

    def _arm(self) -> None:
        self.due = time.perf_counter() + TICK
        self.queued = _runqueue_ns()
        self.loop.call_later(TICK, self._tick)

    def _dump(self, lag: float, queued: float) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        head = (
            f"--- {time.time():.3f} tick {lag * 1000:.1f} ms late, {queued * 1000:.1f} ms cpu wait"
        )
        lines = [head + "\n"]
        for ident, frame in sys._current_frames().items():
            if ident != me:
                lines.append(f"thread {names.get(ident, ident)}\n")
                lines += traceback.format_stack(frame, limit=8)
        self.dump.write("".join(lines))  # type: ignore[attr-defined]

    def _tick(self) -> None:
        lag = time.perf_counter() - self.due
        queued = (_runqueue_ns() - self.queued) / 1e9
        if self.dump is not None and lag > DUMP_AFTER:
            self._dump(lag, queued)
        self.ticks += 1
        self.over += lag > 0.005
        if lag > self.worst:
            self.worst, self.worst_queued = lag, queued
        self.worst_rest = max(self.worst_rest, lag - queued)
        now = int(time.time())
        if now != self.second:
            worst, queued_ms = self.worst * 1000, self.worst_queued * 1000
            rest = self.worst_rest * 1000
            self.out.write(  # type: ignore[attr-defined]
                f"{self.second} {self.ticks} {worst:.3f} {queued_ms:.3f} {self.over} {rest:.3f}\n"
            )
            self.second, self.ticks, self.over = now, 0, 0
            self.worst = self.worst_queued = self.worst_rest = 0.0
        self._arm()


_lag_path = os.environ.get("MLXCEL_LOOP_LAG")
if _lag_path:
    _lag_out = open(_lag_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    _dump_path = os.environ.get("MLXCEL_LOOP_DUMP")
    _dump = open(_dump_path, "a") if _dump_path else None  # noqa: SIM115
    _run_forever = asyncio.base_events.BaseEventLoop.run_forever
    _ticking: set[int] = set()

    def _run_forever_ticking(self: asyncio.base_events.BaseEventLoop) -> None:
        main = threading.current_thread() is threading.main_thread()
        if main and id(self) not in _ticking:  # each loop of the main thread, once
            _ticking.add(id(self))
            self.call_soon(_LagTicker, self, _lag_out, _dump)
        _run_forever(self)

    asyncio.base_events.BaseEventLoop.run_forever = _run_forever_ticking  # type: ignore[method-assign]
