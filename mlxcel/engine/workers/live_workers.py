"""The one registry of running worker threads: each is stopped at interpreter exit at the
latest, before the interpreter's teardown takes modules away from under a thread still
working (a daemon thread would otherwise die mid-job or crash in a half-torn-down MLX)."""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol


class StoppableWorker(Protocol):
    """A worker whose `stop` ends its thread after the current job."""

    def stop(self, timeout: float | None = ...) -> None: ...


EXIT_TIMEOUT = 10.0  # seconds each worker gets to finish its current job at exit

_LIVE: weakref.WeakSet[StoppableWorker] = weakref.WeakSet()


def track(worker: StoppableWorker) -> None:
    """`worker`'s thread started: stop it at exit unless `untrack` comes first."""
    _LIVE.add(worker)


def untrack(worker: StoppableWorker) -> None:
    """`worker` stopped: nothing left to do at exit."""
    _LIVE.discard(worker)


@atexit.register
def stop_live_workers() -> None:
    """Stop every worker still running (at interpreter exit)."""
    for worker in list(_LIVE):
        worker.stop(timeout=EXIT_TIMEOUT)
