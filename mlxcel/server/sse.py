"""Server-Sent Events: encoding, keep-alive pings and the streaming response."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, TypeVar

from starlette.responses import StreamingResponse

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
"""The OpenAI end-of-stream marker."""

SSE_PING = ": ping\n\n"
"""A comment line: keeps proxies from closing an idle stream; SSE clients ignore it."""

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


def dumps(payload: Any) -> str:
    """Compact JSON (no spaces), non-ASCII kept as is, as the OpenAI API writes it."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse_data(payload: Any) -> str:
    """One SSE event carrying `payload` as JSON: `data: {...}` and a blank line."""
    return f"data: {dumps(payload)}\n\n"


async def with_keepalive(source: AsyncIterable[T], interval: float) -> AsyncIterator[T | None]:
    """Yield the items of `source`, and None whenever `interval` seconds pass without one.

    `interval` <= 0 turns pings off. The pending read is never cancelled by a ping, so the
    source sees no spurious cancellation; it is cancelled (and the source closed) when the
    consumer stops early.
    """
    iterator = aiter(source)
    if interval <= 0:
        async for item in iterator:
            yield item
        return
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        closer = getattr(iterator, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


def event_stream(body: AsyncIterator[str]) -> StreamingResponse:
    """A `text/event-stream` response over already-encoded SSE lines."""
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
