"""Chat output events → Responses output items and the stream events that build them.

`OutputAssembler.feed(event)` takes one typed output event of `ChatOutputStream`
(reasoning or content text, a call's start, its argument fragments) and returns the
events (dicts with a `type`, no sequence number yet) that add to the output;
`finish(status)` closes every open item. `items` is the output built so far. A streamed
and a non-streamed answer go through the same assembler, so both give the same items.

Items are sequential: opening an item (reasoning, message or function call) closes the
open ones. A reasoning item streams `response.reasoning_text.delta`, a message
`response.output_text.delta` inside one `output_text` part, a call
`response.function_call_arguments.delta`; each ends with its `.done` events and
`response.output_item.done`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
)
from mlxcel.server.openai_common import new_id

IdMaker = Callable[[str], str]


class OutputAssembler:
    """Builds one response's output items from chat deltas (see module docstring)."""

    def __init__(self, *, make_id: IdMaker = new_id) -> None:
        self.items: list[dict[str, Any]] = []
        self._make_id = make_id
        self._open: list[int] = []  # output indexes of open items, in order
        self._calls: dict[int, int] = {}  # chat tool-call index → output index

    # ------------------------------------------------------------------ feeding

    def feed(self, event: OutputEvent) -> list[dict[str, Any]]:
        """The events one chat output event makes (call ends add nothing)."""
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text) if event.text else []
        if isinstance(event, ContentDelta):
            return self._text("message", event.text) if event.text else []
        if isinstance(event, ToolCallStart):
            events = self._open_item("function_call", call_id=event.id, name=event.name)
            self._calls[event.index] = self._open[-1]
            return events
        if isinstance(event, ToolCallArguments):
            return self._arguments(event.index, event.fragment)
        return []

    def finish(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close every open item (`status`: completed or incomplete); the closing events.

        A completed answer with neither a message nor a call gets an empty message, so
        there is always something to read.
        """
        events: list[dict[str, Any]] = []
        if status == "completed" and not any(
            item["type"] in ("message", "function_call") for item in self.items
        ):
            events += self._open_item("message")
        return events + self._close_all(status)

    # ------------------------------------------------------------------ items

    def _current(self, kind: str) -> int | None:
        if self._open and self.items[self._open[-1]]["type"] == kind:
            return self._open[-1]
        return None

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = self._current(kind)
        if index is None:
            events += self._open_item(kind)
            index = self._open[-1]
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        delta_type = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        event: dict[str, Any] = {
            "type": delta_type,
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            event["logprobs"] = []
        events.append(event)
        return events

    def _open_item(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        events = self._close_all("completed")
        index = len(self.items)
        if kind == "message":
            item: dict[str, Any] = {
                "id": self._make_id("msg_"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part: dict[str, Any] | None = {"type": "output_text", "text": "", "annotations": []}
        elif kind == "reasoning":
            item = {"id": self._make_id("rs_"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": self._make_id("fc_"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                **fields,
            }
            part = None
        self.items.append(item)
        self._open.append(index)
        events.append(
            {"type": "response.output_item.added", "output_index": index, "item": _copy(item)}
        )
        if part is not None:
            item["content"].append(part)
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": dict(part),
                }
            )
        return events

    def _arguments(self, chat_index: int, fragment: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chat_index not in self._calls:  # arguments of a call never started: open one
            events += self._open_item("function_call", call_id=self._make_id("call_"), name="")
            self._calls[chat_index] = self._open[-1]
        index = self._calls[chat_index]
        if not fragment:
            return events
        item = self.items[index]
        item["arguments"] += fragment
        if index in self._open:  # a late remainder of a closed call only fixes the item
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": index,
                    "delta": fragment,
                }
            )
        return events

    def _close_all(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index in self._open:
            events += self._close(index, status)
        self._open.clear()
        return events

    def _close(self, index: int, status: str) -> list[dict[str, Any]]:
        item = self.items[index]
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            item["status"] = status
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            text_done = (
                {"type": "response.output_text.done", "logprobs": []}
                if item["type"] == "message"
                else {"type": "response.reasoning_text.done"}
            )
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events.append({**text_done, **common, "text": part["text"]})
            events.append({"type": "response.content_part.done", **common, "part": dict(part)})
            if item["type"] == "message":
                item["status"] = status
        events.append(
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}
        )
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
