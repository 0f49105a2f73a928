"""The result future of a worker job that can stop part-way (audio, images).

`concurrent.futures.Future.cancel()` drops a job that has not started and does nothing to a
running one. A `StoppableFuture`'s `cancel()` also asks a running job to stop at its next
step (a transcription window, a speech chunk, a denoising step); the job polls
`stop_requested()`. Cancelling the future is then the one way to stop a worker job, and it is
what `asyncio.wrap_future` does when its awaiter times out or is cancelled (client gone).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class StoppableFuture(Future[T]):
    """A Future whose `cancel()` also tells a running job to stop at its next step."""

    def __init__(self) -> None:
        super().__init__()
        self._stop = threading.Event()

    def cancel(self) -> bool:
        """Drop the job if it is queued; else ask it to stop (False: it still runs)."""
        self._stop.set()
        return super().cancel()

    def stop_requested(self) -> bool:
        """Whether `cancel()` was called (read by the job between its steps)."""
        return self._stop.is_set()
