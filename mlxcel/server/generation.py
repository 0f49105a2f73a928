"""One generation request's life in the server, the same for every API family.

A route builds its engine request(s) and admits them with `Job.admit`: a full queue, a
memory budget or an invalid request raises its APIError there, before any byte is sent.
`Job.respond` then either collects the output into one JSON body or streams it as SSE,
with keep-alive pings; the request is cancelled whenever the response ends before the
generation does (a client gone before the first byte, mid-stream, or while waiting for a
JSON body). A final event that is not a normal finish becomes the API's error (500, or 503
at shutdown); every request that finishes normally is counted once for `/metrics`, from
the same numbers its answer reports.

What differs per API family is only its `Encoder`: how engine events become that API's
chunks, events and bodies, and how a failure mid-stream is told (each API's own way).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.server.errors import APIError, model_loading, scrub_paths, server_busy
from mlxcel.server.sse import SSE_PING, event_stream, with_keepalive

if TYPE_CHECKING:
    from mlxcel.server.bridge import EngineStream
    from mlxcel.server.state import ServerState

CLIENT_GONE = 499
"""The status of an answer nobody reads any more (the client went away first)."""

NORMAL_FINISH = ("stop", "length")


def engine_failure(final: GenerationEvent) -> APIError | None:
    """The API error of a final event that did not finish normally; None when it did.

    An engine error is a 500 `server_error` (paths scrubbed from its message); a request
    the engine cancelled (the server shutting down) is a 503.
    """
    if final.finish_reason == "error":
        detail = scrub_paths(final.error or "internal error")
        return APIError(500, f"generation failed: {detail}", "server_error")
    if final.finish_reason == "cancelled":
        return server_busy("the server is shutting down")
    return None


class Encoder:
    """One API family's wire shape of a generation; subclasses override what they send.

    Streaming calls, in order: `opening`, then `delta` for each event with output (the
    final one included), `finished` when a sequence ends normally and `closing` once all
    have; or, when a sequence fails, `failed` and nothing after it. Collecting calls `body`
    with every sequence's events. `observe` sees every event either way.
    """

    ping: str = SSE_PING
    """The keep-alive line sent when no event came for `--sse-ping-interval` seconds."""

    def opening(self) -> Iterable[str]:
        """The lines sent before any event (a role chunk, `message_start`...)."""
        return ()

    def observe(self, index: int, event: GenerationEvent) -> None:
        """Any event of sequence `index`, streamed or collected (slot lookups and such)."""

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        """The lines for the output of one event of sequence `index`."""
        return ()

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        """The lines that end sequence `index`, finished normally."""
        return ()

    def closing(self) -> Iterable[str]:
        """The lines after every sequence finished (`[DONE]`, `message_stop`...)."""
        return ()

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        """The lines that end the stream when sequence `index` failed with `error`."""
        return ()

    def failure(self, final: GenerationEvent) -> APIError | None:
        """The error a final event means (None: a normal end, even if not stop/length)."""
        return engine_failure(final)

    def body(self, results: list[list[GenerationEvent]]) -> Any:
        """The JSON body of a collected answer: every sequence's events, in order."""
        raise NotImplementedError

    def abandoned(self, why: str) -> None:
        """The response ended without its answer (`why`: "disconnected" or "failed"):
        called only then, never after a collected body or a stream that was sent to its
        end (`closing` or `failed`)."""


class Job:
    """The admitted engine streams of one HTTP request and how they are answered."""

    def __init__(self, state: ServerState, streams: Sequence[EngineStream]) -> None:
        self.state = state
        self.streams = list(streams)
        self.started = time.perf_counter()
        self.answered = False  # a stream's last line (closing or failed) went out

    @classmethod
    def admit(cls, state: ServerState, requests: Sequence[GenerationRequest]) -> Job:
        """Submit `requests` now; any refusal (400/503) raises before a response starts,
        and the ones already submitted are cancelled."""
        client = state.client
        if client is None:
            raise model_loading()
        streams: list[EngineStream] = []
        try:
            for request in requests:
                streams.append(client.open(request))
        except BaseException:
            for opened in streams:
                opened.close()
            raise
        return cls(state, streams)

    @property
    def request(self) -> GenerationRequest:
        """The (first) engine request."""
        return self.streams[0].request

    def close(self) -> None:
        """Cancel every sequence still running."""
        for stream in self.streams:
            stream.close()

    # ------------------------------------------------------------------ answering

    async def respond(self, raw: Request, encoder: Encoder, *, stream: bool) -> Response:
        """The HTTP answer: an SSE stream (`stream`), else one JSON body (499 when the
        client went away first; the API error when generation failed)."""
        if stream:

            def on_close() -> None:
                self.close()
                if not self.answered:
                    encoder.abandoned("disconnected")

            return event_stream(self.sse(encoder), on_close=on_close)
        try:
            results = await self.collect(raw, encoder)
            if results is None:  # `collect` told the encoder the client went away
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(encoder.body(results))
        except BaseException:
            encoder.abandoned("failed")
            raise

    async def collect(
        self, raw: Request, encoder: Encoder | None = None
    ) -> list[list[GenerationEvent]] | None:
        """Every sequence's events, run to the end; None when the client went away first
        (its sequences are cancelled). Raises the API error of a failed sequence."""
        encoder = encoder or Encoder()
        results: list[list[GenerationEvent]] = [[] for _ in self.streams]

        async def gather() -> None:
            async for index, event in self._merged():
                encoder.observe(index, event)
                results[index].append(event)

        if not await _unless_disconnected(gather(), raw):
            self.close()
            encoder.abandoned("disconnected")
            return None
        first_error: APIError | None = None
        for events in results:
            error = self._settle(events[-1], encoder)
            first_error = first_error or error
        if first_error is not None:
            raise first_error
        return results

    async def sse(self, encoder: Encoder) -> AsyncIterator[str]:
        """The stream's SSE lines, from `opening` to `closing` (or `failed`)."""
        try:
            for line in encoder.opening():
                yield line
            remaining = len(self.streams)
            async for item in self._pinged():
                if item is None:
                    yield encoder.ping
                    continue
                index, event = item
                encoder.observe(index, event)
                if not event.finished:
                    for line in encoder.delta(index, event):
                        yield line
                    continue
                error = self._settle(event, encoder)
                if error is not None:
                    for line in encoder.failed(index, event, error):
                        yield line
                    self.answered = True
                    return
                if event.text or event.token_ids or event.logprobs:
                    for line in encoder.delta(index, event):
                        yield line
                for line in encoder.finished(index, event):
                    yield line
                remaining -= 1
            if remaining == 0:
                for line in encoder.closing():
                    yield line
                self.answered = True
        finally:
            self.close()

    # ------------------------------------------------------------------ internals

    def _settle(self, final: GenerationEvent, encoder: Encoder) -> APIError | None:
        """Count a normally finished sequence; the error of a failed one."""
        error = encoder.failure(final)
        if error is None and final.finish_reason in NORMAL_FINISH:
            self.state.counters.record(final, time.perf_counter() - self.started)
        return error

    def _merged(self) -> AsyncIterator[tuple[int, GenerationEvent]]:
        if len(self.streams) == 1:
            return _indexed(self.streams[0])
        return _merge(self.streams)

    async def _pinged(self) -> AsyncIterator[tuple[int, GenerationEvent] | None]:
        """`(index, event)` in arrival order, and None for each keep-alive tick."""
        interval = self.state.settings.sse_ping_interval
        if len(self.streams) == 1:
            async for event in with_keepalive(self.streams[0], interval):
                yield None if event is None else (0, event)
            return
        async for item in with_keepalive(_merge(self.streams), interval):
            yield item


async def _indexed(stream: EngineStream) -> AsyncIterator[tuple[int, GenerationEvent]]:
    async for event in stream:
        yield 0, event


async def _merge(streams: list[EngineStream]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Events of several streams as `(index, event)`, in arrival order."""
    queue: asyncio.Queue[tuple[int, GenerationEvent]] = asyncio.Queue()

    async def pump(index: int, stream: EngineStream) -> None:
        async for event in stream:
            await queue.put((index, event))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, event = await queue.get()
            yield index, event
            if event.finished:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(work: Any, request: Request) -> bool:
    """Run the coroutine `work` to its end; False (and `work` cancelled) when the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        return False
    task.result()  # an error while gathering is the caller's
    return True
