"""Worker queues count only the jobs still wanted: a job cancelled while it waits (its
caller timed out or went away) frees its place at once, not when the worker reaches it."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlxcel.engine.errors import QueueFullError
from mlxcel.engine.workers.batch_worker import BatchItem, BatchWorker
from mlxcel.engine.workers.job_queue import JobQueue


@dataclass
class _Job:
    name: str
    future: Future[Any] = field(default_factory=Future)


def test_a_cancelled_job_frees_its_place() -> None:
    jobs: JobQueue[_Job] = JobQueue(2)
    a, b, c = _Job("a"), _Job("b"), _Job("c")
    assert jobs.put(a) and jobs.put(b)
    assert not jobs.put(c) and jobs.waiting == 2  # full
    assert a.future.cancel()
    assert jobs.waiting == 1
    assert jobs.put(c)  # the cancelled job's place
    assert not jobs.put(_Job("d"))
    # The reader still gets every job in order (it skips the cancelled one itself).
    assert [jobs.get_nowait() for _ in range(3)] == [a, b, c]
    assert jobs.waiting == 0
    with pytest.raises(queue.Empty):
        jobs.get_nowait()


def test_taking_a_job_frees_its_place_once() -> None:
    jobs: JobQueue[_Job] = JobQueue(1)
    a = _Job("a")
    assert jobs.put(a)
    assert jobs.get() is a and jobs.waiting == 0
    a.future.set_result(1)  # finishing it later changes nothing
    assert jobs.waiting == 0
    assert jobs.put(_Job("b")) and jobs.waiting == 1


def test_wake_is_outside_the_depth() -> None:
    jobs: JobQueue[_Job] = JobQueue(1)
    assert jobs.put(_Job("a"))
    jobs.wake()  # never refused, even full
    assert jobs.get() is not None and jobs.get() is None


def test_batch_worker_takes_a_new_job_once_a_waiting_one_is_cancelled() -> None:
    """The running job blocks the thread; the one waiting is cancelled (a 504 at its
    caller); a third request is queued instead of refused with 503, and runs."""
    release = threading.Event()
    started = threading.Event()

    def blocking(batch: list[Any]) -> list[Any]:
        started.set()
        release.wait(10)
        return list(batch)

    def job(value: str) -> BatchItem:
        return BatchItem(
            prepare=lambda: [value], forward=blocking, finish=lambda out: out[0], key="k"
        )

    worker = BatchWorker("test-worker", batch_size=1, queue_depth=1).start()
    try:
        running = worker.submit(job("running"))
        assert started.wait(10)
        waiting = worker.submit(job("waiting"))
        with pytest.raises(QueueFullError):
            worker.submit(job("refused"))
        assert waiting.cancel()
        assert worker.pending == 0
        after = worker.submit(job("after"))
        release.set()
        assert running.result(10) == "running"
        assert after.result(10) == "after"
        assert waiting.cancelled()
    finally:
        release.set()
        worker.stop()
