"""Messages answers: the chat job's output as Anthropic content blocks, JSON or SSE.

A request is translated (`convert`) and admitted by the chat path (`ChatServing.start`), so
every 400 and 503 comes before any byte is sent. Its output goes through the chat output
plan; the plan's pieces (reasoning, content, tool-call fragments) become `thinking`, `text`
and `tool_use` blocks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxcel.engine.text.request import GenerationEvent
from mlxcel.server.anthropic_messages.convert import anthropic_tool_id, to_chat_request
from mlxcel.server.anthropic_messages.protocol import (
    CountTokensRequest,
    MessagesRequest,
    StopReason,
    message_object,
    text_block,
    thinking_block,
    tool_use_block,
    usage,
)
from mlxcel.server.errors import server_busy
from mlxcel.server.openai_chat.serving import ChatJob, ChatServing
from mlxcel.server.openai_common import (
    check_final,
    client_finish_reason,
    collect_events,
    new_id,
    record_request,
    reported_model,
    scrub_paths,
)
from mlxcel.server.sse import dumps, event_stream, sse_template, with_keepalive

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState

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
    """A call's JSON arguments as the `input` object (empty when they are not an object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool call arguments are not a JSON object: %.200r", arguments)
        return {}
    return value


def content_blocks(message: dict[str, Any], with_thinking: bool = True) -> list[dict[str, Any]]:
    """The content blocks of a chat `message` (thinking, text, tool_use; never empty)."""
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if with_thinking and reasoning:
        blocks.append(thinking_block(reasoning))
    if message.get("content"):
        blocks.append(text_block(message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            tool_use_block(
                anthropic_tool_id(call["id"]), function["name"], tool_input(function["arguments"])
            )
        )
    return blocks or [text_block("")]


class BlockEvents:
    """Turns chat stream pieces into content-block events, one block open at a time.

    `feed(pieces)` returns the SSE events the pieces make (a block starts when the kind of
    output changes: thinking, text, or a new tool call); `close()` ends the last block, or
    sends one empty text block when the answer had none.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None
        self.tool_blocks: dict[int, int] = {}  # chat call index -> block index
        self._text_delta: Callable[[str], str] | None = None

    def feed(self, pieces: Sequence[dict[str, Any]]) -> list[str]:
        """The events for a list of chat `delta` objects."""
        out: list[str] = []
        for piece in pieces:
            if piece.get("reasoning_content"):
                out += self._text("thinking", piece["reasoning_content"])
            if piece.get("content"):
                out += self._text("text", piece["content"])
            for call in piece.get("tool_calls") or []:
                out += self._call(call)
        return out

    def close(self) -> list[str]:
        """The events that end the content: the last block's stop."""
        out = self._start("text", text_block("")) if self.index < 0 else []
        return out + self._stop()

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open != kind:
            out += self._start(kind, thinking_block("") if kind == "thinking" else text_block(""))
        if kind == "text":
            assert self._text_delta is not None
            out.append(self._text_delta(text))
        else:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        out: list[str] = []
        chat_index = int(call.get("index", 0))
        function = call.get("function") or {}
        if call.get("id") is not None:  # the first fragment of a call: id and name
            name = str(function.get("name") or "")
            out += self._start("tool_use", tool_use_block(anthropic_tool_id(call["id"]), name, {}))
            self.tool_blocks[chat_index] = self.index
        fragment = function.get("arguments") or ""
        if fragment:
            index = self.tool_blocks.get(chat_index, self.index)
            out.append(self._delta({"type": "input_json_delta", "partial_json": fragment}, index))
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


def stream_error(final: GenerationEvent) -> str:
    """The `error` event for a generation that failed (or was cancelled) mid-stream."""
    if final.finish_reason == "cancelled":
        error = {"type": "overloaded_error", "message": "the server is shutting down"}
    else:
        detail = scrub_paths(final.error or "internal error")
        error = {"type": "api_error", "message": f"generation failed: {detail}"}
    return sse_event("error", {"type": "error", "error": error})


class MessagesServing:
    """Runs Messages requests through the chat path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.chat = ChatServing(state)

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        """Answer one request: a message object, or its SSE events once admitted."""
        job = await self.chat.start(to_chat_request(body), raw)
        message_id = new_id("msg_")
        model = reported_model(self.state, body.model)
        stops = tuple(body.stop_sequences or ())
        if body.stream:
            return event_stream(
                self._stream(job, message_id, model, stops), on_close=job.stream.close
            )
        return await self._complete(job, message_id, model, stops, raw)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """POST /v1/messages/count_tokens: the tokens of the prompt `body` renders to."""
        if self.state.tokenizer is None:
            raise server_busy("loading model")
        tokens = await self.chat.prompt_tokens(to_chat_request(body))
        return {"input_tokens": len(tokens)}

    async def _complete(
        self, job: ChatJob, message_id: str, model: str, stops: Sequence[str], raw: Request
    ) -> Response:
        events = await collect_events(job.stream, raw)
        if events is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        final = events[-1]
        check_final(final)
        record_request(self.state, final, time.perf_counter() - job.started)
        result = job.plan.parse("".join(e.text for e in events))
        job.check_forced(result)
        message = job.plan.message(result)
        reason, sequence = stop_reason(
            client_finish_reason(final), bool(result.calls), final.stop_word, stops
        )
        blocks = content_blocks(message, with_thinking=not job.plan.reasoning_in_content)
        return JSONResponse(
            message_object(
                message_id,
                model,
                blocks,
                stop_reason=reason,
                stop_sequence=sequence,
                input_tokens=final.prompt_tokens,
                output_tokens=final.completion_tokens,
            )
        )

    async def _stream(
        self, job: ChatJob, message_id: str, model: str, stops: Sequence[str]
    ) -> AsyncIterator[str]:
        stream = job.stream
        out = job.plan.stream(message_id)
        blocks = BlockEvents()
        start = message_object(
            message_id,
            model,
            [],
            stop_reason=None,
            stop_sequence=None,
            input_tokens=job.prompt_tokens,
            output_tokens=0,
        )
        try:
            yield sse_event("message_start", {"type": "message_start", "message": start})
            final: GenerationEvent | None = None
            async for event in with_keepalive(stream, self.state.settings.sse_ping_interval):
                if event is None:
                    yield SSE_PING
                    continue
                if event.text:
                    for line in blocks.feed(out.feed(event.text)):
                        yield line
                if event.finished:
                    final = event  # the stream ends right after its finishing event
            if final is None:
                return
            engine_reason = client_finish_reason(final)
            if engine_reason == "error":
                yield stream_error(final)
                return
            for line in blocks.feed(out.finish()) + blocks.close():
                yield line
            record_request(self.state, final, time.perf_counter() - job.started)
            assert out.result is not None
            job.check_forced(out.result)
            reason, sequence = stop_reason(
                engine_reason, bool(out.result.calls), final.stop_word, stops
            )
            yield sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(final.prompt_tokens, final.completion_tokens),
                },
            )
            yield sse_event("message_stop", {"type": "message_stop"})
        finally:
            stream.close()
