"""Stream deltas → the `delta` objects of OpenAI chat-completion chunks.

`StreamingToolCallAssembler.step` turns the deltas of one step (one generated token) into
zero or more chunk `delta` objects, in order:

* text: `{"reasoning_content": ...}` and/or `{"content": ...}` (one object for a run of text);
* a call's start: `{"tool_calls": [{"index", "id", "type": "function",
  "function": {"name", "arguments": ""}}]}` — its own object;
* argument text: `{"tool_calls": [{"index", "function": {"arguments": ...}}]}`, one object
  per run of fragments of the same call.

Ids are made once per call (`call_...`, or what the format prefers) and kept. At the end,
`reconcile` compares what was streamed with the authoritative parse of the whole output:
streamed calls keep their id and receive only the missing remainder, calls never streamed get
a start object and an arguments object, and any disagreement is logged at warning level with
the request id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    ParseResult,
    ReasoningDelta,
    ToolCallFormat,
    new_call_id,
)

log = logging.getLogger(__name__)


@dataclass
class _StreamedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


def start_piece(index: int, call_id: str, name: str) -> dict[str, Any]:
    """The `delta` that opens call `index`."""
    return {
        "tool_calls": [
            {
                "index": index,
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ]
    }


def arguments_piece(index: int, fragment: str) -> dict[str, Any]:
    """A `delta` carrying argument text of call `index`."""
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class StreamingToolCallAssembler:
    """Builds chunk `delta` objects for one streamed choice (see module docstring)."""

    def __init__(
        self,
        *,
        new_id: Callable[[], str] = new_call_id,
        request_id: str = "",
    ) -> None:
        self._new_id = new_id
        self._request_id = request_id
        self._calls: dict[int, _StreamedCall] = {}
        self._content: list[str] = []
        self._reasoning: list[str] = []

    @classmethod
    def for_format(
        cls, fmt: ToolCallFormat | None, request_id: str = ""
    ) -> StreamingToolCallAssembler:
        """An assembler using `fmt`'s id style (Mistral templates need 9-character ids)."""
        return cls(new_id=fmt.new_call_id if fmt else new_call_id, request_id=request_id)

    @property
    def content_sent(self) -> str:
        """All content sent so far."""
        return "".join(self._content)

    @property
    def reasoning_sent(self) -> str:
        """All reasoning sent so far."""
        return "".join(self._reasoning)

    def step(self, deltas: Sequence[Delta]) -> list[dict[str, Any]]:
        """The chunk `delta` objects for one step's deltas ([] when nothing is visible)."""
        pieces: list[dict[str, Any]] = []
        last: dict[str, Any] | None = None
        last_index = -1  # the call whose arguments `last` carries, or -1 for text
        for delta in deltas:
            if isinstance(delta, (ContentDelta, ReasoningDelta)):
                if not delta.text:
                    continue
                key = "content" if isinstance(delta, ContentDelta) else "reasoning_content"
                (self._content if key == "content" else self._reasoning).append(delta.text)
                # Text joins the text object before it, but reasoning never follows content.
                if (
                    last is not None
                    and last_index == -1
                    and not (key == "reasoning_content" and "content" in last)
                ):
                    last[key] = last.get(key, "") + delta.text
                else:
                    last = {key: delta.text}
                    last_index = -1
                    pieces.append(last)
                continue
            if delta.name is not None:
                opened = _StreamedCall(delta.id or self._new_id(), delta.name)
                self._calls[delta.index] = opened
                pieces.append(start_piece(delta.index, opened.id, opened.name))
                last, last_index = None, -2
            streamed = self._calls.get(delta.index)
            if streamed is None or not delta.arguments_fragment:
                continue
            streamed.arguments.append(delta.arguments_fragment)
            if last is not None and last_index == delta.index:
                entry = last["tool_calls"][0]["function"]
                entry["arguments"] += delta.arguments_fragment
            else:
                last = arguments_piece(delta.index, delta.arguments_fragment)
                last_index = delta.index
                pieces.append(last)
        return pieces

    def reconcile(self, final: ParseResult) -> list[dict[str, Any]]:
        """What the stream still owes so that it matches `final` (the whole-output parse)."""
        pieces: list[dict[str, Any]] = []
        for key, sent, value in (
            ("reasoning_content", self._reasoning, final.reasoning or ""),
            ("content", self._content, final.content),
        ):
            streamed = "".join(sent)
            if value == streamed:
                continue
            if value.startswith(streamed):
                sent.append(value[len(streamed) :])
                pieces.append({key: value[len(streamed) :]})
            else:
                self._warn(f"streamed {key} differs from the final parse")
        for index, call in enumerate(final.calls):
            streamed_call = self._calls.get(index)
            if streamed_call is None:
                streamed_call = _StreamedCall(call.id or self._new_id(), call.name)
                self._calls[index] = streamed_call
                pieces.append(start_piece(index, streamed_call.id, call.name))
            elif streamed_call.name != call.name:
                self._warn(
                    f"tool call {index} streamed as {streamed_call.name!r}, parsed as {call.name!r}"
                )
            sent_arguments = "".join(streamed_call.arguments)
            if call.arguments.startswith(sent_arguments):
                rest = call.arguments[len(sent_arguments) :]
                if rest:
                    streamed_call.arguments.append(rest)
                    pieces.append(arguments_piece(index, rest))
            else:
                self._warn(f"tool call {index} arguments differ from the final parse")
        extra = sorted(i for i in self._calls if i >= len(final.calls))
        if extra:
            self._warn(f"tool calls {extra} were streamed but are not in the final parse")
        return pieces

    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls sent so far, as `message.tool_calls` entries (ids as streamed)."""
        return [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": "".join(call.arguments)},
            }
            for _, call in sorted(self._calls.items())
        ]

    def _warn(self, what: str) -> None:
        log.warning("request %s: %s", self._request_id or "-", what)


def message_tool_calls(
    result: ParseResult, new_id: Callable[[], str] = new_call_id
) -> list[dict[str, Any]]:
    """`message.tool_calls` for a non-streamed result (fresh ids unless the model gave one)."""
    return [
        {
            "id": call.id or new_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in result.calls
    ]
