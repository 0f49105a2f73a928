"""Bridge between the engine thread and asyncio handlers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from mlxcel.engine.errors import ContextLengthError, InvalidRequestError, QueueFullError
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.server.errors import APIError, bad_request, server_busy


class EngineStream:
    """One submitted request: an async iterator over its events; cancels on close.

    Created by `EngineClient.open`, which submits synchronously, so a full queue or an
    invalid request raises before any response (or SSE header) is sent.
    """

    def __init__(self, engine: Any, request: GenerationRequest) -> None:
        self._engine = engine
        self.request = request
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._done = False

    def _sink(self, event: GenerationEvent) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[GenerationEvent]:
        try:
            while True:
                event = await self._queue.get()
                yield event
                if event.finished:
                    self._done = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the request if it is still running (client gone, handler error)."""
        if not self._done:
            self._done = True
            self._engine.cancel(self.request.request_id)


class EngineClient:
    """What HTTP handlers use to run text generation; never touches MLX itself."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def open(self, request: GenerationRequest) -> EngineStream:
        """Submit `request` now (raising APIError on 400/503) and return its stream."""
        stream = EngineStream(self.engine, request)
        try:
            self.engine.submit(request, stream._sink)
        except QueueFullError as exc:
            raise server_busy() from exc
        except ContextLengthError as exc:
            raise bad_request(str(exc), code="context_length_exceeded") from exc
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from exc
        return stream

    async def complete(
        self, request: GenerationRequest
    ) -> tuple[str, GenerationEvent, list[GenerationEvent]]:
        """Run `request` to the end: (text, final event, all events)."""
        stream = self.open(request)
        events: list[GenerationEvent] = []
        async for event in stream:
            events.append(event)
        final = events[-1]
        if final.finish_reason == "error":
            raise APIError(
                500, f"generation failed: {final.error or 'internal error'}", "server_error"
            )
        return "".join(e.text for e in events), final, events
