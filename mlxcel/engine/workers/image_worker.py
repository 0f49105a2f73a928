"""The image worker: one thread that owns the image pipeline, one request at a time.

It is a `BatchWorker` whose batches hold a single job, so it inherits the bounded queue
(QueueFullError at once when full, which the server answers with 503 before any work), the
deadline check before a job starts and the clean stop. A job past the per-request timeout
stops at its next denoising step and fails with WorkerTimeoutError (504); cancelling its
`StoppableFuture` (the client went away) stops it there too. Errors of the request itself
(ImageStoppedError, InvalidRequestError) come back through the future without a logged
traceback.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxcel.engine.errors import EngineError
from mlxcel.engine.workers.batch_worker import BatchItem, BatchWorker
from mlxcel.engine.workers.errors import WorkerTimeoutError
from mlxcel.engine.workers.stoppable_future import StoppableFuture

if TYPE_CHECKING:
    from mlxcel.engine.image import GeneratedPicture, ImageModel, ImageRequest
    from mlxcel.engine.image.pipeline import StepCallback

DEFAULT_IMAGE_QUEUE_DEPTH = 4
DEFAULT_IMAGE_TIMEOUT = 600.0


class _Task:
    """One image request as the single 'sequence' of a one-job batch."""

    def __init__(
        self,
        model: ImageModel,
        job: ImageRequest,
        on_step: StepCallback | None,
        timeout: float | None,
        future: StoppableFuture[list[GeneratedPicture]],
    ) -> None:
        self.model = model
        self.job = job
        self.on_step = on_step
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout if timeout else None
        self.future = future

    def __len__(self) -> int:
        return 1

    def should_stop(self) -> bool:
        past_deadline = self.deadline is not None and time.monotonic() > self.deadline
        return past_deadline or self.future.stop_requested()

    def prepare(self) -> list[_Task]:
        return [self]

    @staticmethod
    def forward(batch: Sequence[_Task]) -> list[Any]:
        task = batch[0]
        try:
            pictures = task.model.generate(
                task.job, on_step=task.on_step, should_stop=task.should_stop
            )
        except EngineError as exc:  # the request's own failure: no traceback in the log
            return [exc]
        return [pictures]

    def finish(self, outputs: list[Any]) -> list[GeneratedPicture]:
        result = outputs[0]
        if isinstance(result, BaseException):
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise WorkerTimeoutError.after(self.timeout or 0.0) from result
            raise result
        return result  # type: ignore[no-any-return]


class ImageWorker:
    """Image jobs for one loaded `ImageModel` on a dedicated thread."""

    def __init__(
        self,
        model: ImageModel,
        *,
        queue_depth: int = DEFAULT_IMAGE_QUEUE_DEPTH,
        timeout: float | None = DEFAULT_IMAGE_TIMEOUT,
        name: str | None = None,
    ) -> None:
        self.model = model
        self.timeout = timeout if timeout and timeout > 0 else None
        self.worker = BatchWorker(
            name or f"mlxcel-image[{model.name}]", batch_size=1, queue_depth=queue_depth
        )

    @property
    def queue_depth(self) -> int:
        return self.worker.queue_depth

    @property
    def pending(self) -> int:
        """Requests waiting (not counting the one running)."""
        return self.worker.pending

    @property
    def running(self) -> bool:
        return self.worker.running

    def start(self) -> ImageWorker:
        """Start the thread."""
        self.worker.start()
        return self

    def stop(self) -> None:
        """Stop after the current job; queued jobs fail with WorkerStoppedError."""
        self.worker.stop()

    def submit(
        self, job: ImageRequest, *, on_step: StepCallback | None = None
    ) -> StoppableFuture[list[GeneratedPicture]]:
        """Check and queue `job`; its future's `cancel()` stops it at the next step.

        InvalidRequestError when the job does not fit the model, QueueFullError when the
        queue is full, both before any work.
        """
        self.model.check(job)
        future: StoppableFuture[list[GeneratedPicture]] = StoppableFuture()
        task = _Task(self.model, job, on_step, self.timeout, future)
        self.worker.submit(
            BatchItem(
                prepare=task.prepare,
                forward=_Task.forward,
                finish=task.finish,
                key="image",
                size=1,
                deadline=task.deadline,
                future=future,
            )
        )
        return future
