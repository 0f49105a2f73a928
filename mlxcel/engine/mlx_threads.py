"""Long-lived threads that engines and workers run on, reused from one model to the next.

MLX gives each thread that uses it its own streams, backed by native threads, and keeps
them until the process ends: `mx.clear_streams()` only leaves the thread unable to use MLX
again, and the native threads stay. A thread per engine would leave them behind at every
load, so a router switching models would grow without bound. Engines and workers instead
run their loop with `run_pooled`: it runs on an idle pooled thread (a new one only when every
pooled thread is busy) and the thread goes back to the pool when the loop returns, its MLX
streams ready for the next one. The pool holds as many threads as ever ran at once.

Pooled threads are daemons that never end, so MLX's teardown never sees a thread end
while it holds streams (which can abort the process at exit).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class ThreadRun:
    """One loop running on a pooled thread, joined like a `threading.Thread`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = threading.Event()

    def is_alive(self) -> bool:
        """Whether the loop is still running."""
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop returned (at most `timeout` seconds)."""
        self._done.wait(timeout)


class _PooledThread:
    """One daemon thread running the loops handed to it, one after the other."""

    def __init__(self, index: int) -> None:
        self._work: queue.SimpleQueue[tuple[Callable[[], None], ThreadRun]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"mlxcel-mlx-{index}", daemon=True)
        self.thread.start()

    def hand(self, target: Callable[[], None], run: ThreadRun) -> None:
        self._work.put((target, run))

    def _serve(self) -> None:
        me = threading.current_thread()
        idle_name = me.name
        while True:
            target, run = self._work.get()
            me.name = run.name  # as a thread of its own would be named
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - reported as a thread's would be
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, me))
                )
            finally:
                me.name = idle_name
                del target
                _give_back(self)  # idle before the run ends: a join then a start reuses it
                run._done.set()


_lock = threading.Lock()
_idle: list[_PooledThread] = []
_count = 0


def _give_back(pooled: _PooledThread) -> None:
    with _lock:
        _idle.append(pooled)


def run_pooled(target: Callable[[], None], name: str) -> ThreadRun:
    """Run `target` on an idle pooled thread (named `name` meanwhile), a new one if none."""
    global _count
    with _lock:
        if _idle:
            pooled = _idle.pop()
        else:
            _count += 1
            pooled = _PooledThread(_count)
    run = ThreadRun(name)
    pooled.hand(target, run)
    return run


def pooled_threads() -> int:
    """How many pooled threads exist (busy or idle)."""
    with _lock:
        return _count
