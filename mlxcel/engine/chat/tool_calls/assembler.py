"""Stream deltas → a chat answer's typed output events, with stable call ids.

`StreamingToolCallAssembler.step` turns the deltas of one step (one generated token) into
output events, in order: `ContentDelta` / `ReasoningDelta` (empty text dropped), and for a
call `ToolCallStart(index, id, name)` once, then `ToolCallArguments(index, fragment)`.

Ids are made once per call (`call_...`, or what the format prefers) and kept. At the end,
`reconcile` compares what was streamed with the authoritative parse of the whole output:
streamed calls keep their id and receive only the missing remainder, calls never streamed
get a start and their arguments, every call then gets its `ToolCallEnd`, and any
disagreement is logged at warning level with the request id. Turning the events into an
API's wire shape is the server's work (one encoder per API family).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    OutputEvent,
    ParseResult,
    ReasoningDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallFormat,
    ToolCallStart,
    new_call_id,
)

log = logging.getLogger(__name__)


@dataclass
class _StreamedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class StreamingToolCallAssembler:
    """Builds the output events of one streamed answer (see module docstring)."""

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

    def step(self, deltas: Sequence[Delta]) -> list[OutputEvent]:
        """The output events of one step's deltas ([] when nothing is visible)."""
        events: list[OutputEvent] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                if delta.text:
                    self._content.append(delta.text)
                    events.append(delta)
                continue
            if isinstance(delta, ReasoningDelta):
                if delta.text:
                    self._reasoning.append(delta.text)
                    events.append(delta)
                continue
            if delta.name is not None:
                opened = _StreamedCall(delta.id or self._new_id(), delta.name)
                self._calls[delta.index] = opened
                events.append(ToolCallStart(delta.index, opened.id, opened.name))
            streamed = self._calls.get(delta.index)
            if streamed is None or not delta.arguments_fragment:
                continue
            streamed.arguments.append(delta.arguments_fragment)
            events.append(ToolCallArguments(delta.index, delta.arguments_fragment))
        return events

    def reconcile(self, final: ParseResult) -> list[OutputEvent]:
        """What the stream still owes so that it matches `final` (the whole-output parse),
        then the end of every call."""
        events: list[OutputEvent] = []
        texts: tuple[tuple[type[ContentDelta | ReasoningDelta], str, list[str], str], ...] = (
            (ReasoningDelta, "reasoning", self._reasoning, final.reasoning or ""),
            (ContentDelta, "content", self._content, final.content),
        )
        for kind, label, sent, value in texts:
            streamed = "".join(sent)
            if value == streamed:
                continue
            if value.startswith(streamed):
                sent.append(value[len(streamed) :])
                events.append(kind(value[len(streamed) :]))
            else:
                self._warn(f"streamed {label} differs from the final parse")
        for index, call in enumerate(final.calls):
            streamed_call = self._calls.get(index)
            if streamed_call is None:
                streamed_call = _StreamedCall(call.id or self._new_id(), call.name)
                self._calls[index] = streamed_call
                events.append(ToolCallStart(index, streamed_call.id, call.name))
            elif streamed_call.name != call.name:
                self._warn(
                    f"tool call {index} streamed as {streamed_call.name!r}, parsed as {call.name!r}"
                )
            sent_arguments = "".join(streamed_call.arguments)
            if call.arguments.startswith(sent_arguments):
                rest = call.arguments[len(sent_arguments) :]
                if rest:
                    streamed_call.arguments.append(rest)
                    events.append(ToolCallArguments(index, rest))
            else:
                self._warn(f"tool call {index} arguments differ from the final parse")
        extra = sorted(i for i in self._calls if i >= len(final.calls))
        if extra:
            self._warn(f"tool calls {extra} were streamed but are not in the final parse")
        events += [ToolCallEnd(index) for index in sorted(self._calls)]
        return events

    def calls(self) -> tuple[ToolCall, ...]:
        """The calls sent so far, in index order, with the ids they were sent with."""
        return tuple(
            ToolCall(call.name, "".join(call.arguments), call.id)
            for _, call in sorted(self._calls.items())
        )

    def _warn(self, what: str) -> None:
        log.warning("request %s: %s", self._request_id or "-", what)
