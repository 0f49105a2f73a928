"""The engine-to-HTTP seam: how handlers wait on engine threads, and how engine errors
become HTTP answers.

Two shapes cross it. A text generation is a stream of events (`EngineClient.open`); a side
worker's request (embeddings, rerank, audio, images) is one `concurrent.futures.Future`
(`await_engine`). Either way an engine exception becomes its answer through one table,
`engine_error_answer`, whichever family raised it.

Events cross threads through one `_Dispatcher` per event loop: the engine thread appends to
a deque and wakes the loop only when no drain is already pending; with an engine that
flushes its sinks after each step (`TextEngine`), the events of one decode step (one per
running stream) cost one loop wake-up instead of one each (a wake-up is a syscall and a
thread switch, the largest per-token cost of the bridge). Each stream then hands its
events to its reader through a plain deque and one waiter future; SSE keep-alive pings
come from one timer per interval (`with_pings`), not from a timeout per event.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from mlxcel.engine.audio.phonemize import PhonemizerUnavailable
from mlxcel.engine.distributed.group import GroupBrokenError
from mlxcel.engine.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    QueueFullError,
    RequestMemoryBudgetError,
)
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.engine.workers.audio import AudioUnavailableError
from mlxcel.engine.workers.errors import (
    WorkerCrashedError,
    WorkerStoppedError,
    WorkerTimeoutError,
)
from mlxcel.server.errors import (
    APIError,
    bad_request,
    context_too_long,
    memory_budget_exceeded,
    not_implemented,
    server_busy,
    timeout_error,
)

if TYPE_CHECKING:
    from mlxcel.server.engine_protocol import GenerationEngine

T = TypeVar("T")


def engine_error_answer(exc: EngineError) -> APIError | None:
    """The HTTP answer to an engine exception, for every engine family; None for an engine
    error with no answer of its own (it becomes a 500 like any unexpected exception).

    A full queue is 503 `server_busy` with the spec's one message; a memory budget 503; a
    stopped worker or a broken group of ranks 503; a deadline 504; a worker that died
    mid-request 500; no model for the request 501; a bad request 400
    (`context_length_exceeded` for a long prompt).
    """
    match exc:
        case GroupBrokenError():
            return APIError(503, str(exc), "unavailable_error")
        case QueueFullError():
            return server_busy()
        case RequestMemoryBudgetError():
            return memory_budget_exceeded(exc.estimated_bytes, exc.budget_bytes, str(exc))
        case WorkerStoppedError():
            return APIError(503, str(exc), "unavailable_error")
        case WorkerTimeoutError():
            return timeout_error(str(exc))
        case WorkerCrashedError():
            return APIError(500, str(exc), "server_error")
        case AudioUnavailableError():
            return not_implemented(str(exc))
        case PhonemizerUnavailable():  # an InvalidRequestError: the model cannot, not the client
            return APIError(501, str(exc), "not_supported_error")
        case ContextLengthError():
            return context_too_long(exc)
        case InvalidRequestError():
            return bad_request(str(exc))
    return None


@contextmanager
def engine_errors() -> Iterator[None]:
    """Raise an engine error of the block as its HTTP answer (`engine_error_answer`)."""
    try:
        yield
    except EngineError as exc:
        answer = engine_error_answer(exc)
        if answer is None:
            raise
        raise answer from exc


async def await_engine(submit: Callable[[], Future[T]], timeout: float | None) -> T:
    """Submit a request to an engine worker and await its result without blocking the loop.

    `submit` runs here, so a full queue or an invalid request is answered before any work.
    Past `timeout` seconds (None: no limit), or when the awaiting handler is cancelled (the
    client went away), the future is cancelled: a queued request is dropped, and a running
    one on a worker that returns a `StoppableFuture` (audio, images) stops at its next step.
    Engine errors, raised by `submit` or through the future, become their HTTP answer.
    """
    with engine_errors():
        waiter = asyncio.wrap_future(submit())
        try:
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            if timeout is None or not waiter.cancelled():
                raise  # the job's own TimeoutError, not the wait's
            raise WorkerTimeoutError.after(timeout) from None


class _Dispatcher:
    """Moves events from the engine thread onto one event loop, one wake-up per burst."""

    __slots__ = ("_loop", "_pending", "_scheduled", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: deque[tuple[EngineStream, GenerationEvent]] = deque()
        self._scheduled = False

    def post(self, stream: EngineStream, event: GenerationEvent) -> None:
        """Engine thread: queue `event` for `stream` and wake the loop (unless it is due)."""
        self._pending.append((stream, event))
        self._wake()

    def hold(self, stream: EngineStream, event: GenerationEvent) -> None:
        """Engine thread: queue `event` for `stream` until the next `flush`."""
        self._pending.append((stream, event))

    def flush(self) -> None:
        """Engine thread: wake the loop for every held event."""
        if self._pending:
            self._wake()

    def _wake(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody reads these events any more
                self._scheduled = False

    def _drain(self) -> None:
        # Cleared before popping: an event queued from now on is either popped below or
        # wakes the loop again, so none is left behind.
        self._scheduled = False
        pending = self._pending
        while pending:
            stream, event = pending.popleft()
            stream._deliver(event)


class _HeldSink:
    """A stream's sink for engines that flush sinks (`TextEngine.flushes_sinks`): events
    wait for the engine's `flush()` at the end of its step, so all the streams of one
    decode step cost a single loop wake-up."""

    __slots__ = ("_stream", "_hold", "flush")

    def __init__(self, stream: EngineStream) -> None:
        self._stream = stream
        self._hold = stream._dispatcher.hold
        self.flush = stream._dispatcher.flush

    def __call__(self, event: GenerationEvent) -> None:
        self._hold(self._stream, event)


_dispatchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Dispatcher] = (
    weakref.WeakKeyDictionary()
)


def _dispatcher(loop: asyncio.AbstractEventLoop) -> _Dispatcher:
    dispatcher = _dispatchers.get(loop)
    if dispatcher is None:
        dispatcher = _dispatchers[loop] = _Dispatcher(loop)
    return dispatcher


class EngineStream:
    """One submitted request: an async iterator over its events; cancels on close.

    Created by `EngineClient.open`, which submits synchronously, so a full queue or an
    invalid request raises before any response (or SSE header) is sent.
    """

    def __init__(self, engine: GenerationEngine, request: GenerationRequest) -> None:
        self._engine = engine
        self.request = request
        self._loop = asyncio.get_running_loop()
        self._dispatcher = _dispatcher(self._loop)
        self._events: deque[GenerationEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._wait_started = 0.0
        self._done = False

    def _sink(self, event: GenerationEvent) -> None:
        """Engine thread: pass `event` on to the loop."""
        self._dispatcher.post(self, event)

    def _deliver(self, event: GenerationEvent) -> None:
        """Loop thread: make `event` available to the reader."""
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_event(self) -> GenerationEvent | None:
        """The next event; None when a keep-alive tick (`with_pings`) ended the wait first."""
        events = self._events
        if not events:
            waiter = self._loop.create_future()
            self._waiter = waiter
            self._wait_started = self._loop.time()
            try:
                await waiter
            finally:
                self._waiter = None
            if not events:
                return None
        return events.popleft()

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationEvent]:
        try:
            while True:
                event = await self.next_event()
                if event is None:
                    continue
                yield event
                if event.finished:
                    self._done = True
                    return
        finally:
            self.close()

    async def with_pings(self, interval: float) -> AsyncIterator[GenerationEvent | None]:
        """The events, and None whenever `interval` seconds pass without one (SSE pings).

        One timer per interval checks how long the reader has been waiting, instead of a
        timeout per event.
        """
        loop = self._loop
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal timer
            due = loop.time() + interval
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waited_until = self._wait_started + interval
                if loop.time() >= waited_until:
                    waiter.set_result(None)  # a ping: the wait ends without an event
                else:
                    due = waited_until
            timer = loop.call_at(due, tick)

        timer = loop.call_at(loop.time() + interval, tick)
        try:
            while True:
                event = await self.next_event()
                yield event
                if event is not None and event.finished:
                    self._done = True
                    return
        finally:
            timer.cancel()
            self.close()

    def close(self) -> None:
        """Cancel the request if it is still running (client gone, handler error)."""
        if not self._done:
            self._done = True
            self._engine.cancel(self.request.request_id)


class EngineClient:
    """What HTTP handlers use to run text generation; never touches MLX itself."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine

    def open(self, request: GenerationRequest) -> EngineStream:
        """Submit `request` now (raising APIError on 400/503) and return its stream."""
        stream = EngineStream(self.engine, request)
        held = self.engine.flushes_sinks
        with engine_errors():
            self.engine.submit(request, _HeldSink(stream) if held else stream._sink)
        return stream
