"""Chat completions on the wire: engine events → `chat.completion` bodies and chunks.

The request's life (admission, pings, cancel, errors, counting) is `generation.Job`'s; this
module only shapes its output. A failure after the stream started sends the finish chunk
with `finish_reason: "error"`, then an OpenAI error event (`data: {"error": {...}}`, which
the OpenAI SDKs raise on) and `[DONE]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    OutputEvent,
    ParseResult,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallFormat,
    ToolCallStart,
    new_call_id,
)
from mlxcel.engine.chat.tool_calls.output import finish_reason, reasoning_only
from mlxcel.engine.text.request import GenerationEvent, TokenLogprob
from mlxcel.server.errors import APIError, sse_error_data
from mlxcel.server.generation import Encoder
from mlxcel.server.openai_common import (
    chat_logprobs,
    choice_chunk,
    envelope,
    speculative_timings,
    usage_chunk,
    usage_payload,
)
from mlxcel.server.sse import SSE_DONE, sse_template

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.openai_chat.serving import ChatJob


def delta_objects(events: Iterable[OutputEvent]) -> list[dict[str, Any]]:
    """The chunk `delta` objects of one step's output events, in order.

    A run of text is one object (`reasoning_content` and/or `content`; reasoning never
    follows content in one object); a call's start is its own object (`index`, `id`,
    `type`, `function.name`, empty `arguments`); a run of argument fragments of one call
    is one object. Call ends have no wire form here.
    """
    pieces: list[dict[str, Any]] = []
    last: dict[str, Any] | None = None
    last_index = -1  # the call whose arguments `last` carries, or -1 for text
    for event in events:
        if isinstance(event, (ContentDelta, ReasoningDelta)):
            key = "content" if isinstance(event, ContentDelta) else "reasoning_content"
            if (
                last is not None
                and last_index == -1
                and not (key == "reasoning_content" and "content" in last)
            ):
                last[key] = last.get(key, "") + event.text
            else:
                last, last_index = {key: event.text}, -1
                pieces.append(last)
        elif isinstance(event, ToolCallStart):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": function}
            pieces.append({"tool_calls": [call]})
            last, last_index = None, -2
        elif isinstance(event, ToolCallArguments):
            if last is not None and last_index == event.index:
                last["tool_calls"][0]["function"]["arguments"] += event.fragment
            else:
                function = {"arguments": event.fragment}
                last = {"tool_calls": [{"index": event.index, "function": function}]}
                last_index = event.index
                pieces.append(last)
    return pieces


def message_tool_calls(
    result: ParseResult, tool_format: ToolCallFormat | None = None
) -> list[dict[str, Any]]:
    """`message.tool_calls` of a non-streamed result (fresh ids unless the model gave one,
    in the format's id style)."""
    new_id = tool_format.new_call_id if tool_format else new_call_id
    return [
        {
            "id": call.id or new_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in result.calls
    ]


def message_fields(
    result: ParseResult, *, tool_format: ToolCallFormat | None = None
) -> dict[str, Any]:
    """The assistant `message` of a non-streamed answer: content (None when only calls),
    reasoning_content, tool_calls and reasoning_only, each only when it applies."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": result.content if result.content or not result.calls else None,
    }
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.calls:
        message["tool_calls"] = message_tool_calls(result, tool_format)
    if reasoning_only(result):
        message["reasoning_only"] = True
    return message


CHUNK = "chat.completion.chunk"


class ChatEncoder(Encoder):
    """One chat completion (a single choice), as JSON or as chunks."""

    def __init__(
        self,
        chat: ChatJob,
        tokenizer: Tokenizer,
        meta: dict[str, Any],
        *,
        include_usage: bool = False,
    ) -> None:
        self.chat = chat
        self.tokenizer = tokenizer
        self.meta = meta
        self.include_usage = include_usage
        self.want_logprobs = chat.job.request.logprobs is not None
        self._out = chat.plan.stream(meta["id"])
        self._content_chunk = sse_template(lambda text: self._chunk({"content": text}))

    def _chunk(
        self,
        delta: dict[str, Any],
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        choice = {"delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return choice_chunk(self.meta, CHUNK, choice, extra)

    # ------------------------------------------------------------------ streaming

    def opening(self) -> Iterable[str]:
        return [self._chunk({"role": "assistant"})]

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        lines: list[str] = []
        logprobs = (
            {"content": chat_logprobs(self.tokenizer, list(event.logprobs))}
            if self.want_logprobs and event.logprobs
            else None
        )
        pieces = delta_objects(self._out.feed(event.text)) if event.text else []
        if logprobs is not None:
            # One SSE position per generated token: a placeholder when all is held.
            first, *pieces = pieces or [{"content": ""}]
            lines.append(self._chunk(first, logprobs=logprobs))
        for piece in pieces:
            text = piece.get("content") if len(piece) == 1 else None
            lines.append(self._content_chunk(text) if type(text) is str else self._chunk(piece))
        return lines

    def _close_output(self, engine_reason: str, extra: dict[str, Any]) -> list[str]:
        lines = [self._chunk(piece) for piece in delta_objects(self._out.finish())]
        assert self._out.result is not None
        self.chat.check_forced(self._out.result)
        last: dict[str, Any] = {"reasoning_only": True} if self._out.reasoning_only else {}
        reason = finish_reason(self._out.result, engine_reason)
        lines.append(self._chunk(last, reason, extra=extra))
        return lines

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        lines = self._close_output(final.finish_reason or "stop", speculative_timings(final))
        if self.include_usage:
            lines.append(usage_chunk(self.meta, CHUNK, final))
        return lines

    def closing(self) -> Iterable[str]:
        return [SSE_DONE]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return [*self._close_output("error", {}), sse_error_data(error), SSE_DONE]

    # ------------------------------------------------------------------ collected

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        events = results[0]
        final = events[-1]
        plan = self.chat.plan
        result = self.chat.parse(events)
        logprobs: list[TokenLogprob] = [lp for e in events for lp in e.logprobs]
        return {
            **envelope(self.meta, "chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": plan.message(result),
                    "finish_reason": finish_reason(result, final.finish_reason or "stop"),
                    "logprobs": {"content": chat_logprobs(self.tokenizer, logprobs)}
                    if self.want_logprobs
                    else None,
                }
            ],
            "usage": usage_payload(final.prompt_tokens, final.completion_tokens),
            **speculative_timings(final),
        }
