"""Typed SSE events of a streamed response: `event: <type>` + `data:` with a sequence number.

Every event of one stream carries `type` and `sequence_number` (0, 1, 2, ... in the order
sent). There is no `[DONE]` sentinel: the stream ends after `response.completed`,
`response.incomplete` or `response.failed`.
"""

from __future__ import annotations

from typing import Any

from mlxcel.server.sse import dumps


class EventWriter:
    """Numbers and encodes the events of one stream."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def payload(self, event: dict[str, Any]) -> dict[str, Any]:
        """`event` (with its `type`) plus the next sequence number."""
        out = {"type": event["type"], "sequence_number": self.sequence_number}
        out.update((k, v) for k, v in event.items() if k != "type")
        self.sequence_number += 1
        return out

    def sse(self, event: dict[str, Any]) -> str:
        """`event` as one SSE message: an `event:` line and a `data:` line."""
        data = self.payload(event)
        return f"event: {data['type']}\ndata: {dumps(data)}\n\n"

    def lifecycle(self, kind: str, response: dict[str, Any]) -> str:
        """`response.<kind>` (created, in_progress, completed...) carrying `response`."""
        return self.sse({"type": f"response.{kind}", "response": response})
