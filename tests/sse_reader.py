"""Reading server-sent events in tests: the one place that knows the `data: ` wire format.

A body given as text is split into lines the way httpx's `iter_lines` splits a stream
(`str.splitlines`), so a JSON payload holding a raw line-breaking character fails here as
it would fail a streaming client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

DONE = "[DONE]"  # the OpenAI end-of-stream payload


@dataclass(frozen=True)
class SSEEvent:
    """One event: its `event:` name (None without one), its `data:` text and the raw block."""

    name: str | None
    data: str
    raw: str

    def json(self) -> Any:
        """The data parsed as JSON."""
        return json.loads(self.data)


def sse_data(line: str) -> str | None:
    """The payload of one `data: ` line; None for any other line."""
    return line[len("data: ") :] if line.startswith("data: ") else None


def _lines(source: str | Iterable[str]) -> Iterable[str]:
    return source.splitlines() if isinstance(source, str) else source


def sse_payloads(source: str | Iterable[str]) -> list[str]:
    """The payload text of every `data: ` line of a body or of its lines (`[DONE]` kept)."""
    return [data for data in map(sse_data, _lines(source)) if data is not None]


def iter_sse_json(source: str | Iterable[str]) -> Iterator[Any]:
    """The JSON of each `data: ` line of a body or of its lines as it comes (`[DONE]` left
    out); stopping early leaves the rest of a stream unread."""
    for line in _lines(source):
        data = sse_data(line)
        if data is not None and data != DONE:
            yield json.loads(data)


def sse_json(source: str | Iterable[str]) -> list[Any]:
    """The JSON of every `data: ` line of a body or of its lines (`[DONE]` left out)."""
    return list(iter_sse_json(source))


def sse_events(text: str) -> list[SSEEvent]:
    """The events of a whole body, in order; blocks holding only comments are left out."""
    events: list[SSEEvent] = []
    for block in text.split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif (payload := sse_data(line)) is not None:
                data.append(payload)
        if name is not None or data:
            events.append(SSEEvent(name, "\n".join(data), block))
    return events


def sse_stream_json(response: httpx.Response, *, done: bool) -> list[Any]:
    """The JSON events of a whole SSE response after checking its wire form: an event stream
    of events that are each one `data: ` line ending in a blank line (keep-alive comments
    aside), ending in `[DONE]` when `done` (OpenAI) or without it (llama-server's native)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("\n\n")
    events = sse_events(response.text)
    assert all(e.raw == f"data: {e.data}" for e in events), response.text
    assert (events[-1].data == DONE) is done
    return [e.json() for e in (events[:-1] if done else events)]


async def aiter_sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split on LF only (as the SSE spec says; httpx's own
    `aiter_lines` also splits inside JSON strings, at U+2028, U+0085 and the like)."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8")
    if pending:
        yield pending.decode("utf-8")
