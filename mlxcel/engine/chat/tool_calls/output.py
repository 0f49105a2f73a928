"""One chat completion's output: generated text → reasoning, content and tool calls.

Streaming, per request::

    out = ChatOutputStream(tool_format=fmt, tools=tools, reasoning=cfg,
                           start_in_reasoning=opened, request_id=rid)
    for each generated token:  events = out.feed(token_text)     # typed output events
    at the end:                events = out.finish()             # flush + reconcile
    out.result                 # the authoritative ParseResult of the whole output

The events are typed (`ContentDelta`, `ReasoningDelta`, `ToolCallStart`,
`ToolCallArguments`, `ToolCallEnd` of `tool_calls.base`); the server's encoder of each API
family turns them into its wire shape. `feed` may return nothing for a token (held text,
suppressed markup). `finish_reason(out.result, engine_reason)` is the answer's reason.

Non-streaming: `parse_chat_output(text, ...)`.

The reasoning split runs first; its content goes through the tool-call format's filter.
Harmony models use one filter for both (their channels carry reasoning, content and calls).
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.chat.reasoning import ReasoningConfig, reasoning_filter, split_reasoning
from mlxcel.engine.chat.tool_calls.assembler import StreamingToolCallAssembler
from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    OutputEvent,
    ParseResult,
    StreamFilter,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    Tools,
)
from mlxcel.engine.chat.tool_calls.harmony import HarmonyFilter, HarmonyFormat


def _is_harmony(tool_format: ToolCallFormat | None, reasoning: ReasoningConfig | None) -> bool:
    return (reasoning is not None and reasoning.harmony) or (
        tool_format is not None and tool_format.name == HarmonyFormat.name
    )


def parse_chat_output(
    text: str,
    *,
    tool_format: ToolCallFormat | None = None,
    tools: Tools | None = None,
    reasoning: ReasoningConfig | None = None,
    start_in_reasoning: bool = False,
) -> ParseResult:
    """Split a whole output: reasoning first, then tool calls in the content.

    `tool_format` None means no tool parsing (content stays as generated, minus reasoning).
    """
    if _is_harmony(tool_format, reasoning):
        return HarmonyFormat().parse(text, tools)
    thought, content = split_reasoning(text, reasoning, start_in_reasoning=start_in_reasoning)
    if tool_format is None:
        return ParseResult(content, (), thought)
    parsed = tool_format.parse(content, tools)
    return ParseResult(parsed.content, parsed.calls, thought)


def reasoning_only(result: ParseResult) -> bool:
    """True when everything generated stayed in reasoning: no content, no calls."""
    return bool(result.reasoning) and not result.content and not result.calls


def finish_reason(result: ParseResult, engine_reason: str) -> str:
    """The client's finish_reason: "tool_calls" when a generation that stopped made calls."""
    return "tool_calls" if result.calls and engine_reason == "stop" else engine_reason


class ChatOutputStream:
    """Streams one choice's output as typed output events (see module docstring).

    `feed` takes the text of one generated token and returns the events it makes
    visible, possibly none (text held back, or markup that is never shown). `finish` flushes
    what is held, parses the whole output and returns what the stream still owes.

    For formats whose calls do not stream (`streams_arguments` false), each call is sent at
    the end of generation as one start object and one arguments object, as the spec says;
    with `defer_whole_calls=False` it is sent as soon as the call is complete instead.
    """

    def __init__(
        self,
        *,
        tool_format: ToolCallFormat | None = None,
        tools: Tools | None = None,
        reasoning: ReasoningConfig | None = None,
        start_in_reasoning: bool = False,
        request_id: str = "",
        defer_whole_calls: bool = True,
    ) -> None:
        self._defer = defer_whole_calls and (
            _is_harmony(tool_format, reasoning)
            or (tool_format is not None and not tool_format.streams_arguments)
        )
        self._options: dict[str, Any] = {
            "tool_format": tool_format,
            "tools": tools,
            "reasoning": reasoning,
            "start_in_reasoning": start_in_reasoning,
        }
        self._first: StreamFilter | None
        self._second: StreamFilter | None
        if _is_harmony(tool_format, reasoning):
            self._first, self._second = HarmonyFilter(tools), None
        else:
            self._first = reasoning_filter(reasoning, start_in_reasoning=start_in_reasoning)
            self._second = tool_format.stream_filter(tools) if tool_format else None
        self._assembler = StreamingToolCallAssembler.for_format(tool_format, request_id)
        self._parts: list[str] = []
        self.result: ParseResult | None = None

    def feed(self, text: str) -> list[OutputEvent]:
        """The events one token's text makes visible ([] if none)."""
        if self.result is not None:
            raise RuntimeError("feed after finish")
        self._parts.append(text)
        first: list[Delta] = self._first.feed(text) if self._first else [ContentDelta(text)]
        return self._assembler.step(self._visible(self._through_tools(first)))

    def finish(self) -> list[OutputEvent]:
        """End of generation: the remaining events, every call's end; sets `result`."""
        if self.result is not None:
            return []
        deltas = self._through_tools(self._first.finish() if self._first else [])
        if self._second is not None:
            deltas += self._second.finish()
        pieces = self._assembler.step(self._visible(deltas))
        self.result = parse_chat_output("".join(self._parts), **self._options)
        return pieces + self._assembler.reconcile(self.result)

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The calls streamed so far (ids as sent)."""
        return self._assembler.calls()

    @property
    def content_sent(self) -> bool:
        """True once any content has been sent."""
        return bool(self._assembler.content_sent)

    @property
    def reasoning_only(self) -> bool:
        """Reasoning was sent, but no content and no calls."""
        return (
            bool(self._assembler.reasoning_sent)
            and not self._assembler.content_sent
            and not self._assembler.calls()
        )

    def _visible(self, deltas: list[Delta]) -> list[Delta]:
        """Deferred whole calls are left to `reconcile`, which sends them at the end."""
        if not self._defer:
            return deltas
        return [d for d in deltas if not isinstance(d, ToolCallDelta)]

    def _through_tools(self, deltas: list[Delta]) -> list[Delta]:
        if self._second is None:
            return deltas
        out: list[Delta] = []
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                out.extend(self._second.feed(delta.text))
            else:
                out.append(delta)
        return out
