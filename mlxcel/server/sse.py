"""Server-Sent Events: encoding, keep-alive pings and the streaming response."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Callable
from json.encoder import encode_basestring as _encode_string  # what dumps() uses for str
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


_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""The non-ASCII characters Python's `str.splitlines` breaks a line at (the ASCII ones are
control characters, which JSON always escapes)."""


def _one_line(encoded: str) -> str:
    """`encoded` JSON with U+0085, U+2028 and U+2029 written as escapes: the same JSON value,
    on one line even for clients that split an event stream with `str.splitlines` (httpx's
    `iter_lines` does) instead of at CR/LF only as the SSE spec says."""
    return encoded if encoded.isascii() else encoded.translate(_LINE_BREAKS)


def dumps(payload: Any) -> str:
    """Compact JSON (no spaces), non-ASCII kept as is, as the OpenAI API writes it (but for
    the three line separators `_one_line` escapes)."""
    return _one_line(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))


def sse_data(payload: Any) -> str:
    """One SSE event carrying `payload` as JSON: `data: {...}` and a blank line."""
    return f"data: {dumps(payload)}\n\n"


def sse_template(build: Callable[[str], str]) -> Callable[[str], str]:
    """A fast equivalent of `build(text)` for events that differ only in one string.

    `build` must encode `text` once, as a JSON string, through `sse_data`/`dumps` (e.g. one
    content delta of a stream). It is called once with a random marker; the returned
    function then only JSON-escapes each `text` between the two constant halves, giving
    the same bytes as `build(text)` for a fraction of the cost. Falls back to `build`
    when the marker does not appear exactly once.
    """
    marker = dumps(f"\x00{secrets.token_hex(8)}\x00")
    parts = build(json.loads(marker)).split(marker)
    if len(parts) != 2:
        return build
    head, tail = parts

    def render(text: str) -> str:
        return head + _one_line(_encode_string(text)) + tail

    return render


def with_keepalive(source: AsyncIterable[T], interval: float) -> AsyncIterator[T | None]:
    """Yield the items of `source`, and None whenever `interval` seconds pass without one.

    `interval` <= 0 turns pings off. The pending read is never cancelled by a ping, so the
    source sees no spurious cancellation; it is cancelled (and the source closed) when the
    consumer stops early. A source with its own `with_pings(interval)` (the engine bridge's
    streams) is used directly: no wrapper and no task per item.
    """
    if interval > 0:
        with_pings = getattr(source, "with_pings", None)
        if with_pings is not None:
            pinged: AsyncIterator[T | None] = with_pings(interval)
            return pinged
    return _keepalive(source, interval)


async def _keepalive(source: AsyncIterable[T], interval: float) -> AsyncIterator[T | None]:
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


class _ClosingStreamingResponse(StreamingResponse):
    """A `text/event-stream` response that runs `on_close` however it ends.

    A client that disconnects before the first chunk means the body generator never starts,
    so its own `finally` never runs: the request would keep its slot until it finished."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def event_stream(body: AsyncIterator[str], *, on_close: Callable[[], None]) -> StreamingResponse:
    """A `text/event-stream` response over already-encoded SSE lines; `on_close` (e.g. the
    engine stream's `close`, which cancels the request if it still runs) is called when the
    response ends for any reason, including a client gone before the first chunk."""
    return _ClosingStreamingResponse(body, on_close)
