"""Messages answers on the wire: engine events → Anthropic content blocks, JSON or SSE.

The request is translated (`convert`) and admitted by the chat core (`ChatCore.start`);
its life is `generation.Job`'s. Its output goes through the chat output plan; its typed
events (reasoning, content, tool-call starts and argument fragments) become `thinking`,
`text` and `tool_use` blocks. A failure after the stream started is an `error` event,
Anthropic's way, and the stream ends there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    OutputEvent,
    ParseResult,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallStart,
    new_call_id,
)
from mlxcel.engine.chat.tool_calls.jsonscan import complete_members
from mlxcel.engine.text.request import GenerationEvent
from mlxcel.server.anthropic_messages.convert import anthropic_tool_id
from mlxcel.server.anthropic_messages.protocol import (
    StopReason,
    message_object,
    text_block,
    thinking_block,
    tool_use_block,
    usage,
)
from mlxcel.server.errors import APIError, anthropic_error_type
from mlxcel.server.generation import Encoder
from mlxcel.server.sse import dumps, sse_template

if TYPE_CHECKING:
    from mlxcel.server.chat.admitted import AdmittedChat

log = logging.getLogger(__name__)


def sse_event(name: str, payload: dict[str, Any]) -> str:
    """One named SSE event, as the Messages API streams them."""
    return f"event: {name}\ndata: {dumps(payload)}\n\n"


SSE_PING = sse_event("ping", {"type": "ping"})


def stop_reason(
    engine_reason: str, made_calls: bool, stop_word: str | None, stop_sequences: Sequence[str]
) -> tuple[StopReason, str | None]:
    """(`stop_reason`, `stop_sequence`) for a generation that ended with `engine_reason`."""
    if engine_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if stop_word is not None and stop_word in stop_sequences:
        return "stop_sequence", stop_word
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as the `input` object (empty when they are not an object).

    Arguments cut off by max_tokens give the members generated whole so far (the block is
    kept, with stop_reason "max_tokens", as Anthropic answers a cut-off tool_use).
    """
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = complete_members(arguments)
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object: %.200r", arguments)
        return {}
    return value


def content_blocks(
    result: ParseResult, new_id: Callable[[], str] = new_call_id
) -> list[dict[str, Any]]:
    """The content blocks of a whole answer (thinking, text, tool_use; never empty); calls
    without the model's own id get `new_id()` (as `toolu_...`)."""
    blocks: list[dict[str, Any]] = []
    if result.reasoning:
        blocks.append(thinking_block(result.reasoning))
    if result.content:
        blocks.append(text_block(result.content))
    for call in result.calls:
        call_id = anthropic_tool_id(call.id or new_id())
        blocks.append(tool_use_block(call_id, call.name, tool_input(call.arguments)))
    return blocks or [text_block("")]


class BlockEvents:
    """Turns a chat answer's output events into content-block events, one block open at a
    time.

    `feed(events)` returns the SSE events they make (a block starts when the kind of output
    changes: thinking, text, or a new tool call); `close()` ends the last block, or sends
    one empty text block when the answer had none.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.tool_blocks: dict[int, int] = {}  # chat call index -> block index
        self._text_delta: Callable[[str], str] | None = None

    def feed(self, events: Sequence[OutputEvent]) -> list[str]:
        """The SSE events for a list of output events."""
        out: list[str] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                out += self._text("thinking", event.text)
            elif isinstance(event, ContentDelta):
                out += self._text("text", event.text)
            elif isinstance(event, ToolCallStart):
                block = tool_use_block(anthropic_tool_id(event.id), event.name, {})
                out += self._start("tool_use", block)
                self.tool_blocks[event.index] = self.index
            elif isinstance(event, ToolCallArguments) and event.fragment:
                index = self.tool_blocks.get(event.index, self.index)
                delta = {"type": "input_json_delta", "partial_json": event.fragment}
                out.append(self._delta(delta, index))
        return out

    def close(self) -> list[str]:
        """The events that end the content: the last block's stop."""
        out = self._start("text", text_block("")) if self.index < 0 else []
        return out + self._stop()

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if not text:
            return out
        if self.open != kind:
            out += self._start(kind, thinking_block("") if kind == "thinking" else text_block(""))
        if kind == "text":
            assert self._text_delta is not None
            out.append(self._text_delta(text))
        else:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> str:
        payload = {
            "type": "content_block_delta",
            "index": self.index if index is None else index,
            "delta": delta,
        }
        return sse_event("content_block_delta", payload)

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._stop()
        self.index += 1
        self.open = kind
        if kind == "text":
            self._text_delta = sse_template(
                lambda text: self._delta({"type": "text_delta", "text": text})
            )
        payload = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*out, sse_event("content_block_start", payload)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        payload = {"type": "content_block_stop", "index": self.index}
        return [sse_event("content_block_stop", payload)]


class MessagesEncoder(Encoder):
    """One Messages answer: a message object, or its SSE event sequence."""

    ping = SSE_PING

    def __init__(
        self, chat: AdmittedChat, message_id: str, model: str, stop_sequences: Sequence[str]
    ) -> None:
        self.chat = chat
        self.message_id = message_id
        self.model = model
        self.stops = tuple(stop_sequences)
        self._out = chat.plan.stream(message_id)
        self._blocks = BlockEvents()
        self._started = False

    def _reason(self, final: GenerationEvent, made_calls: bool) -> tuple[StopReason, str | None]:
        return stop_reason(final.finish_reason or "stop", made_calls, final.stop_word, self.stops)

    # ------------------------------------------------------------------ streaming

    def opening(self) -> Iterable[str]:
        return ()  # `message_start` waits for the prompt-cache count (`_start`)

    def _start(self, cached: int) -> list[str]:
        """`message_start`, once: sent at the first event, whose prompt progress (the
        engine reports one before any token when the prompt cache served part of the
        prompt) carries the cached tokens; a token event without it means none were."""
        if self._started:
            return []
        self._started = True
        start = message_object(
            self.message_id,
            self.model,
            [],
            stop_reason=None,
            stop_sequence=None,
            prompt_tokens=self.chat.prompt_tokens,
            output_tokens=0,
            cached_tokens=cached,
        )
        return [sse_event("message_start", {"type": "message_start", "message": start})]

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        if event.progress is not None:
            return self._start(event.progress.cache)
        lines = self._start(_cached(event))
        return lines + self._blocks.feed(self._out.feed(event.text)) if event.text else lines

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        lines = self._start(_cached(final))
        lines += self._blocks.feed(self._out.finish()) + self._blocks.close()
        assert self._out.result is not None
        self.chat.check_forced(self._out.result)
        reason, sequence = self._reason(final, bool(self._out.result.calls))
        lines.append(
            sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(final.prompt_tokens, final.completion_tokens, _cached(final)),
                },
            )
        )
        return lines

    def closing(self) -> Iterable[str]:
        return [sse_event("message_stop", {"type": "message_stop"})]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        payload = {"type": anthropic_error_type(error.status), "message": error.message}
        return [sse_event("error", {"type": "error", "error": payload})]

    # ------------------------------------------------------------------ collected

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        final = results[0][-1]
        plan = self.chat.plan
        result = self.chat.parse(results[0])
        reason, sequence = self._reason(final, bool(result.calls))
        fmt = plan.tool_format
        blocks = content_blocks(plan.shown(result), fmt.new_call_id if fmt else new_call_id)
        return message_object(
            self.message_id,
            self.model,
            blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            prompt_tokens=final.prompt_tokens,
            output_tokens=final.completion_tokens,
            cached_tokens=_cached(final),
        )


def _cached(final: GenerationEvent) -> int:
    """Prompt tokens the engine took from its prompt cache for this answer."""
    return final.timings.cache_n if final.timings is not None else 0
