"""A batching worker thread with a bounded queue, for embedding and rerank models.

Each job is tokenized on the worker (`prepare`), its sequences are run together with the
sequences of the other queued jobs that share its `key`, in batches of at most `batch_size`
sequences of similar length, and `finish` turns its outputs into the job's result. Results
come back through `concurrent.futures.Future`, so async handlers await them without ever
touching MLX. The worker has its own MLX stream and thread: it never blocks the text engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence, Sized
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mlxcel.engine.embeddings.embedder import plan_batches
from mlxcel.engine.errors import QueueFullError
from mlxcel.engine.mlx_threads import ThreadRun, run_pooled
from mlxcel.engine.workers import live_workers
from mlxcel.engine.workers.errors import (
    WorkerCrashedError,
    WorkerStoppedError,
    WorkerTimeoutError,
)
from mlxcel.engine.workers.job_queue import JobQueue

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32
DEFAULT_QUEUE_DEPTH = 64


@dataclass
class BatchItem:
    """One request for a worker.

    `prepare` runs on the worker and returns the sequences to run (anything with `len`);
    `forward` runs a batch of sequences (jobs with equal `key` are batched together);
    `finish` gets this job's outputs in `prepare` order and returns the result.
    """

    prepare: Callable[[], Sequence[Sized]]
    forward: Callable[[Sequence[Any]], list[Any]]
    finish: Callable[[list[Any]], Any]
    key: Hashable
    size: int = 1  # inputs in the job, to fill batches before tokenizing
    deadline: float | None = None  # time.monotonic() after which the job is dropped
    future: Future[Any] = field(default_factory=Future)


@dataclass
class WorkerStats:
    """Counters a worker keeps (read by /metrics and the CLI)."""

    jobs: int = 0
    sequences: int = 0
    batches: int = 0
    failures: int = 0
    timeouts: int = 0
    restarts: int = 0
    busy_seconds: float = 0.0


class BatchWorker:
    """A daemon thread serving jobs from a bounded queue."""

    def __init__(
        self,
        name: str,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch size must be at least 1")
        if queue_depth < 1:
            raise ValueError("queue depth must be at least 1")
        self.name = name
        self.batch_size = batch_size
        self.queue_depth = queue_depth
        self.stats = WorkerStats()
        self._queue: JobQueue[BatchItem] = JobQueue(queue_depth)
        self._thread: ThreadRun | None = None
        self._stopping = threading.Event()

    @property
    def pending(self) -> int:
        """Jobs waiting in the queue (a cancelled one no longer counts)."""
        return self._queue.waiting

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> BatchWorker:
        """Start the thread (idempotent); it is stopped at interpreter exit at the latest."""
        if not self.running:
            self._stopping.clear()
            self._thread = run_pooled(self._run, self.name)
            live_workers.track(self)
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop after the current batch; jobs still queued fail with WorkerStoppedError."""
        self._stopping.set()
        self._queue.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._queue.drain(WorkerStoppedError(f"{self.name} stopped"))
        live_workers.untrack(self)

    def submit(self, job: BatchItem) -> Future[Any]:
        """Queue `job`; QueueFullError at once when `queue_depth` jobs still wanted wait."""
        if self._stopping.is_set():
            raise WorkerStoppedError(f"{self.name} is not running")
        if self._thread is not None and not self._thread.is_alive():  # it died: restart
            self.stats.restarts += 1
            self.start()
        if not self._queue.put(job):
            raise QueueFullError(f"{self.name}: {self.queue_depth} requests already waiting")
        return job.future

    # --- the thread ------------------------------------------------------------------

    def _run(self) -> None:
        # On a pooled thread (`mlx_threads`): it evaluates on that thread's MLX streams,
        # which stay for the next worker or engine.
        while not self._stopping.is_set():
            first = self._queue.get()
            if first is None:
                break
            jobs = self._gather(first)
            started = time.perf_counter()
            try:
                self._serve(jobs)
            except BaseException as exc:  # the worker died mid-batch: restart it
                self._crashed(jobs, exc)
            finally:
                self.stats.busy_seconds += time.perf_counter() - started

    def _crashed(self, jobs: list[BatchItem], exc: BaseException) -> None:
        """Fail the batch's unfinished jobs cleanly and keep serving (a restart in place)."""
        log.error("%s: worker died mid-batch (%s); restarted", self.name, type(exc).__name__)
        self.stats.failures += 1
        self.stats.restarts += 1
        error = WorkerCrashedError(f"{self.name} died while running the request; it restarted")
        for job in jobs:
            future = job.future
            if future.done():
                continue
            if future.running() or future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _gather(self, first: BatchItem) -> list[BatchItem]:
        """`first` plus queued jobs while they fit in one batch of sequences."""
        jobs = [first]
        count = first.size
        while count < self.batch_size:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._stopping.set()
                break
            jobs.append(job)
            count += job.size
        return jobs

    def _serve(self, jobs: list[BatchItem]) -> None:
        prepared: list[tuple[BatchItem, list[Any]]] = []
        now = time.monotonic()
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue  # the client went away or timed out while queued
            if job.deadline is not None and now > job.deadline:
                self.stats.timeouts += 1
                job.future.set_exception(WorkerTimeoutError("the request timed out in the queue"))
                continue
            try:
                prepared.append((job, list(job.prepare())))
            except Exception as exc:  # an invalid input fails its own job only
                self.stats.failures += 1
                job.future.set_exception(exc)
        groups: dict[Hashable, list[tuple[BatchItem, list[Any]]]] = {}
        for entry in prepared:
            groups.setdefault(entry[0].key, []).append(entry)
        for members in groups.values():
            self._run_group(members)

    def _run_group(self, members: list[tuple[BatchItem, list[Any]]]) -> None:
        flat = [(j, i) for j, (_, items) in enumerate(members) for i in range(len(items))]
        lengths = [len(members[j][1][i]) for j, i in flat]
        outputs: list[list[Any]] = [[None] * len(items) for _, items in members]
        forward = members[0][0].forward
        try:
            for group in plan_batches(lengths, self.batch_size):
                batch = [members[flat[k][0]][1][flat[k][1]] for k in group]
                for k, out in zip(group, forward(batch), strict=True):
                    outputs[flat[k][0]][flat[k][1]] = out
                self.stats.batches += 1
                self.stats.sequences += len(batch)
        except Exception as exc:
            log.exception("%s: batch failed", self.name)
            self.stats.failures += len(members)
            for job, _ in members:
                job.future.set_exception(exc)
            return
        for (job, _), outs in zip(members, outputs, strict=True):
            try:
                job.future.set_result(job.finish(outs))
                self.stats.jobs += 1
            except Exception as exc:
                self.stats.failures += 1
                job.future.set_exception(exc)
