"""The bounded FIFO in front of a worker thread, counting only jobs still wanted.

A worker's queue depth is what a server answers 503 on. A job whose future is cancelled
while it waits (its caller timed out or went away) will be skipped by the worker, so it
stops counting against the depth at once: the next request is not refused for a slot that
only a dead job holds.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar


class _HasFuture(Protocol):
    @property
    def future(self) -> Future[Any]: ...


J = TypeVar("J", bound=_HasFuture)


class _Entry(Generic[J]):
    __slots__ = ("counted", "job")

    def __init__(self, job: J) -> None:
        self.job = job
        self.counted = True


class JobQueue(Generic[J]):
    """FIFO of jobs with at most `depth` live ones waiting; `None` wakes the reader."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._queue: queue.Queue[_Entry[J] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Jobs queued whose futures are not cancelled yet."""
        return self._waiting

    def put(self, job: J) -> bool:
        """Queue `job`; False (and nothing queued) when `depth` live jobs already wait."""
        entry = _Entry(job)
        with self._lock:
            if self._waiting >= self.depth:
                return False
            self._waiting += 1
            self._queue.put_nowait(entry)
        job.future.add_done_callback(lambda _: self._release(entry))
        return True

    def wake(self) -> None:
        """Queue the `None` that tells a reader to stop (outside the depth)."""
        self._queue.put_nowait(None)

    def get(self) -> J | None:
        """The next job (blocking), or None when woken by `wake`."""
        return self._taken(self._queue.get())

    def get_nowait(self) -> J | None:
        """The next job at once (None: woken by `wake`); queue.Empty when there is none."""
        return self._taken(self._queue.get_nowait())

    def drain(self, error: Exception) -> None:
        """Fail every job still queued and still wanted with `error` (a stopping worker)."""
        while True:
            try:
                job = self.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)

    def _taken(self, entry: _Entry[J] | None) -> J | None:
        if entry is None:
            return None
        self._release(entry)
        return entry.job

    def _release(self, entry: _Entry[J]) -> None:
        with self._lock:
            if entry.counted:
                entry.counted = False
                self._waiting -= 1
