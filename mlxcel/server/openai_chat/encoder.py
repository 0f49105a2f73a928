"""Chat completions on the wire: engine events → `chat.completion` bodies and chunks.

The request's life (admission, pings, cancel, errors, counting) is `generation.Job`'s; this
module only shapes its output. A failure after the stream started sends the finish chunk
with `finish_reason: "error"`, then an OpenAI error event (`data: {"error": {...}}`, which
the OpenAI SDKs raise on) and `[DONE]`.
"""

from __future__ import annotations

import json
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
    usage_of,
)
from mlxcel.server.sse import SSE_DONE, sse_data, sse_template

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.chat.admitted import AdmittedChat
    from mlxcel.server.chat.output_plan import OutputPlan
    from mlxcel.server.llama_native.encoder import VerboseReport


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


def chat_message(plan: OutputPlan, result: ParseResult) -> dict[str, Any]:
    """The non-streamed `message` of `result` under `plan` (deepseek-legacy: the reasoning
    also leads the content, between its tags)."""
    message = message_fields(result, tool_format=plan.tool_format)
    block = plan.legacy_block(result)
    if block is not None:
        message["content"] = block + (message.get("content") or "")
        message.pop("reasoning_only", None)
    return message


CHUNK = "chat.completion.chunk"


class ChatEncoder(Encoder):
    """One chat completion (one choice per engine sequence), as JSON or as chunks."""

    def __init__(
        self,
        chat: AdmittedChat,
        tokenizer: Tokenizer,
        meta: dict[str, Any],
        *,
        include_usage: bool = False,
        verbose: VerboseReport | None = None,
    ) -> None:
        self.chat = chat
        self.verbose = verbose
        self.tokenizer = tokenizer
        self.meta = meta
        self.include_usage = include_usage
        self.want_logprobs = chat.job.request.logprobs is not None
        self._outs = [chat.plan.stream(meta["id"]) for _ in chat.job.streams]
        self._finals: list[GenerationEvent] = []
        self._content_chunk = sse_template(lambda text: self._chunk({"content": text}))

    def _chunk(
        self,
        delta: dict[str, Any],
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        index: int = 0,
    ) -> str:
        choice = {"delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return choice_chunk(self.meta, CHUNK, choice, extra, index)

    # ------------------------------------------------------------------ streaming

    def opening(self) -> Iterable[str]:
        return [self._chunk({"role": "assistant"}, index=i) for i in range(len(self._outs))]

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        if event.progress is not None:  # `return_progress`: llama-server's role chunk
            extra = {"prompt_progress": event.progress.to_dict()}
            return [self._chunk({"role": "assistant", "content": None}, extra=extra, index=index)]
        if self.verbose is not None and index == 0:
            self.verbose.feed(event)
        lines = self._deltas(index, event)
        if event.timings is not None and lines and not event.finished:
            # `timings_per_token`: the event's last chunk carries the timings so far.
            lines[-1] = self._with_timings(lines[-1], event)
        return lines

    def _with_timings(self, line: str, event: GenerationEvent) -> str:
        assert event.timings is not None
        chunk = json.loads(line.removeprefix("data: "))
        return sse_data({**chunk, "timings": event.timings.to_dict()})

    def _deltas(self, index: int, event: GenerationEvent) -> list[str]:
        lines: list[str] = []
        logprobs = (
            {"content": chat_logprobs(self.tokenizer, list(event.logprobs))}
            if self.want_logprobs and event.logprobs
            else None
        )
        pieces = delta_objects(self._outs[index].feed(event.text)) if event.text else []
        if logprobs is not None:
            # One SSE position per generated token: a placeholder when all is held.
            first, *pieces = pieces or [{"content": ""}]
            lines.append(self._chunk(first, logprobs=logprobs, index=index))
        for piece in pieces:
            text = piece.get("content") if len(piece) == 1 else None
            if type(text) is str and index == 0:
                lines.append(self._content_chunk(text))
            else:
                lines.append(self._chunk(piece, index=index))
        return lines

    def _close_output(self, index: int, engine_reason: str, extra: dict[str, Any]) -> list[str]:
        out = self._outs[index]
        lines = [self._chunk(piece, index=index) for piece in delta_objects(out.finish())]
        assert out.result is not None
        self.chat.check_forced(out.result)
        last: dict[str, Any] = {"reasoning_only": True} if out.reasoning_only else {}
        reason = finish_reason(out.result, engine_reason)
        lines.append(self._chunk(last, reason, extra=extra, index=index))
        return lines

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        self._finals.append(final)
        extra = speculative_timings(final)
        if self.verbose is not None and index == 0:
            extra["__verbose"] = self.verbose.streamed(final)
        return self._close_output(index, final.finish_reason or "stop", extra)

    def closing(self) -> Iterable[str]:
        if self.include_usage and self._finals:
            timings = self.chat.job.request.timings_per_token
            return [usage_chunk(self.meta, CHUNK, self._finals, timings=timings), SSE_DONE]
        return [SSE_DONE]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return [*self._close_output(index, "error", {}), sse_error_data(error), SSE_DONE]

    # ------------------------------------------------------------------ collected

    def _choice(self, index: int, events: list[GenerationEvent]) -> dict[str, Any]:
        result = self.chat.parse(events)
        logprobs: list[TokenLogprob] = [lp for e in events for lp in e.logprobs]
        return {
            "index": index,
            "message": chat_message(self.chat.plan, result),
            "finish_reason": finish_reason(result, events[-1].finish_reason or "stop"),
            "logprobs": {"content": chat_logprobs(self.tokenizer, logprobs)}
            if self.want_logprobs
            else None,
        }

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        finals = [events[-1] for events in results]
        return {
            **envelope(self.meta, "chat.completion"),
            "choices": [self._choice(i, events) for i, events in enumerate(results)],
            "usage": usage_of(finals),
            **speculative_timings(finals[0]),
            **({"__verbose": self.verbose.collected(results[0])} if self.verbose else {}),
        }
