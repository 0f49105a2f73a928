"""One Realtime response: the conversation through the chat core's one generation path, its
text streamed as it comes, each finished sentence spoken on the audio worker while the
model goes on, and function calls streamed as items.

Events, in OpenAI's order: `response.created`; per output item `response.output_item.added`
and `conversation.item.added`, then for a message `response.content_part.added`, its deltas
(`response.output_audio_transcript.delta` + `response.output_audio.delta`, or
`response.output_text.delta` for text-only sessions) and their `.done` events, for a call
`response.function_call_arguments.delta/done`; `response.output_item.done` and
`conversation.item.done`; finally `response.done` with the status and usage.

An out-of-band response (`response.create` with `conversation: "none"`) answers from its own
`input` items (or the conversation), sends the same `response.*` events, and adds nothing to
the conversation: no `conversation.item.*` events, `conversation_id` null.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    OutputEvent,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlxcel.engine.errors import EngineError
from mlxcel.engine.voice.sentences import SentenceChunker
from mlxcel.server.chat.core import ChatCore
from mlxcel.server.chat.request import ChatOptions, ChatRequest
from mlxcel.server.errors import APIError
from mlxcel.server.generation import NORMAL_FINISH, engine_failure
from mlxcel.server.openai_responses.serving import chat_tool_choice, chat_tools
from mlxcel.server.realtime.audio_wire import base64_chunks, duration_ms, encode_audio
from mlxcel.server.realtime.conversation import chat_turns, message_item
from mlxcel.server.realtime.protocol import audio_format_wire, event, new_id

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

    from mlxcel.engine.text.request import GenerationEvent
    from mlxcel.engine.workers.audio import AudioWorker
    from mlxcel.server.chat.admitted import AdmittedChat
    from mlxcel.server.realtime.protocol import SessionConfig
    from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

AUDIO_CHUNK_MS = 200
"""Audio per `response.output_audio.delta`."""

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class SpokenSentence:
    """A sentence of an answer and where its audio starts and ends (ms into the item)."""

    text: str
    start_ms: float
    end_ms: float


@dataclass
class ResponseContext:
    """What a response needs from its session."""

    state: ServerState
    websocket: WebSocket
    worker: AudioWorker
    send: Send
    items: list[dict[str, Any]]
    add_item: Callable[[dict[str, Any]], str | None]  # appends, returns the previous item's id
    conversation_id: str | None  # None: an out-of-band response, kept out of the conversation
    spoken: dict[str, list[SpokenSentence]]  # item id → its spoken sentences


@dataclass
class _Message:
    """The open assistant message item."""

    item: dict[str, Any]
    output_index: int
    text: str = ""
    spoken: list[SpokenSentence] = field(default_factory=list)  # whose audio was sent
    audio_ms: float = 0.0


class RealtimeResponse:
    """Runs one response (`run`), or is cancelled mid-way (`cancel`)."""

    def __init__(
        self,
        context: ResponseContext,
        config: SessionConfig,
        response_id: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.context = context
        self.config = config
        self.id = response_id
        self.metadata = metadata
        self.started = 0.0
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self._admitted: AdmittedChat | None = None
        self._message: _Message | None = None
        self._calls: dict[int, tuple[dict[str, Any], int]] = {}  # chat index → (item, output index)
        self._chunker = SentenceChunker()
        self._sentences: asyncio.Queue[str | None] = asyncio.Queue()
        self._speaker: asyncio.Task[None] | None = None
        self._tts_future: Any = None

    # ------------------------------------------------------------------ wire shapes

    def wire(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object of `response.created` / `response.done`."""
        config = self.config
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": status,
            "status_details": details,
            "output": self.output,
            "conversation_id": self.context.conversation_id,
            "output_modalities": list(config.output_modalities),
            "max_output_tokens": (
                "inf" if config.max_output_tokens is None else config.max_output_tokens
            ),
            "audio": {
                "output": {"format": audio_format_wire(config.output_format), "voice": config.voice}
            },
            "usage": self.usage,
            "metadata": self.metadata,
        }

    @property
    def _in_conversation(self) -> bool:
        return self.context.conversation_id is not None

    def _ids(self, output_index: int, item_id: str) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": item_id, "output_index": output_index}

    # ------------------------------------------------------------------ running

    def chat_request(self) -> ChatRequest:
        """The conversation as the chat core's request (400 APIError on bad tools)."""
        config = self.config
        tools = chat_tools(list(config.tools)) if config.tools else None
        choice, tools = chat_tool_choice(config.tool_choice, tools)
        options = ChatOptions.model_validate(
            {} if config.temperature is None else {"temperature": config.temperature}
        )
        return ChatRequest.build(
            chat_turns(config.instructions, self.context.items),
            options,
            max_tokens=config.max_output_tokens,
            tools=tools,
            tool_choice=choice if tools else None,
        )

    async def run(self) -> tuple[str, dict[str, Any] | None]:
        """Generate and speak the answer; (status, status_details) of `response.done`.
        Raises APIError when the request is refused before it starts."""
        context = self.context
        self.started = time.perf_counter()
        admitted = await ChatCore(context.state).start(self.chat_request(), context.websocket)
        self._admitted = admitted
        if self.config.speaks:
            self._speaker = asyncio.ensure_future(self._speak())
        splitter = admitted.plan.stream(admitted.job.request.request_id)
        final: GenerationEvent | None = None
        try:
            async for generated in admitted.stream:
                outputs = splitter.feed(generated.text) if generated.text else []
                if generated.finished:
                    final = generated
                    outputs += splitter.finish()
                for output in outputs:
                    await self._output(output)
        except Exception:  # a bug: the speaker, waiting for sentences, must not be left behind
            await self._stop_speaking()
            raise
        finally:
            admitted.job.close()
        assert final is not None
        failure = engine_failure(final)
        if failure is not None:
            await self._stop_speaking()
            await self._close_message(status="incomplete")
            return "failed", {
                "type": "failed",
                "error": {"type": failure.type, "message": failure.message},
            }
        if final.finish_reason in NORMAL_FINISH:
            context.state.counters.record(final, time.perf_counter() - self.started)
        self.usage = _usage(final.prompt_tokens, final.completion_tokens)
        for sentence in self._chunker.finish():
            self._say(sentence)
        if self._speaker is not None:
            await self._sentences.put(None)
            await self._speaker
        await self._close_message()
        if final.finish_reason == "length":
            return "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        return "completed", None

    async def cancel(self) -> None:
        """Stop generating and speaking (the task running `run` is cancelled by the caller);
        the open message keeps what was spoken and is closed as incomplete."""
        if self._admitted is not None:
            self._admitted.job.close()
        await self._stop_speaking()
        message = self._message
        if message is not None and self.config.speaks:
            message.text = " ".join(s.text for s in message.spoken)
        if message is not None and self.config.speaks and self._in_conversation:
            await self.context.send(
                event(
                    "conversation.item.truncated",
                    item_id=message.item["id"],
                    content_index=0,
                    audio_end_ms=int(message.audio_ms),
                )
            )
        await self._close_message(status="incomplete")
        for index in list(self._calls):
            await self._close_call(index, status="incomplete")

    async def _stop_speaking(self) -> None:
        if self._tts_future is not None:
            self._tts_future.cancel()
        if self._speaker is not None:
            self._speaker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._speaker
            self._speaker = None

    # ------------------------------------------------------------------ output items

    async def _output(self, output: OutputEvent) -> None:
        if isinstance(output, ContentDelta):
            await self._text(output.text)
        elif isinstance(output, ToolCallStart):
            await self._open_call(output)
        elif isinstance(output, ToolCallArguments):
            await self._arguments(output)
        elif isinstance(output, ToolCallEnd):
            await self._close_call(output.index)
        # reasoning is not spoken nor shown

    async def _add_output(self, item: dict[str, Any]) -> None:
        index = len(self.output)
        self.output.append(item)
        if not self._in_conversation:
            await self.context.send(
                event(
                    "response.output_item.added", response_id=self.id, output_index=index, item=item
                )
            )
            return
        previous = self.context.add_item(item)
        send = self.context.send
        await send(
            event("response.output_item.added", response_id=self.id, output_index=index, item=item)
        )
        await send(event("conversation.item.added", previous_item_id=previous, item=item))

    async def _open_message(self) -> _Message:
        speaks = self.config.speaks
        part = (
            {"type": "output_audio", "transcript": ""}
            if speaks
            else {"type": "output_text", "text": ""}
        )
        item = message_item("assistant", [part], status="in_progress")
        # Open before the first await: a response cancelled while the item is announced
        # still closes it (`cancel` closes the open message).
        message = self._message = _Message(item, len(self.output))
        if speaks and self._in_conversation:
            self.context.spoken[item["id"]] = message.spoken
        await self._add_output(item)
        await self.context.send(
            event(
                "response.content_part.added",
                **self._ids(message.output_index, item["id"]),
                content_index=0,
                part={"type": "audio", "transcript": ""}
                if speaks
                else {"type": "text", "text": ""},
            )
        )
        return message

    async def _text(self, text: str) -> None:
        if not text:
            return
        message = self._message or await self._open_message()
        message.text += text
        kind = (
            "response.output_audio_transcript.delta"
            if self.config.speaks
            else "response.output_text.delta"
        )
        await self.context.send(
            event(
                kind,
                **self._ids(message.output_index, message.item["id"]),
                content_index=0,
                delta=text,
            )
        )
        if self.config.speaks:
            for sentence in self._chunker.feed(text):
                self._say(sentence)

    def _say(self, sentence: str) -> None:
        self._sentences.put_nowait(sentence)

    async def _speak(self) -> None:
        """Speak the sentences in order as they come; each one's audio goes out in chunks."""
        config = self.config
        worker = self.context.worker
        while (sentence := await self._sentences.get()) is not None:
            try:
                self._tts_future = worker.speak(sentence, voice=config.voice, speed=config.speed)
                speech = await asyncio.wrap_future(self._tts_future)
            except EngineError as exc:  # unspeakable text (no phonemes), a full queue...
                log.info("realtime %s: sentence not spoken: %s", self.id, exc)
                continue
            finally:
                self._tts_future = None
            message = self._message
            if message is None:
                continue
            data = encode_audio(speech.samples, speech.sample_rate, config.output_format)
            for piece in base64_chunks(data, config.output_format, AUDIO_CHUNK_MS):
                await self.context.send(
                    event(
                        "response.output_audio.delta",
                        **self._ids(message.output_index, message.item["id"]),
                        content_index=0,
                        delta=piece,
                    )
                )
            start = message.audio_ms
            message.audio_ms += duration_ms(data, config.output_format)
            message.spoken.append(SpokenSentence(sentence, start, message.audio_ms))

    async def _close_message(self, status: str = "completed") -> None:
        """Close the open message: its item takes its final text and `status` before any
        event is sent, so a response cancelled mid-close (the client left, barge-in) never
        leaves an `in_progress` item in the conversation."""
        message, self._message = self._message, None
        if message is None:
            return
        speaks = self.config.speaks
        if speaks and status == "completed":
            message.text = message.text.strip()
        kind = "audio" if speaks else "text"
        field_name = "transcript" if speaks else "text"
        message.item["content"] = [{"type": f"output_{kind}", field_name: message.text}]
        message.item["status"] = status
        send = self.context.send
        ids = self._ids(message.output_index, message.item["id"])
        if speaks:
            await send(event("response.output_audio.done", **ids, content_index=0))
            await send(
                event(
                    "response.output_audio_transcript.done",
                    **ids,
                    content_index=0,
                    transcript=message.text,
                )
            )
        else:
            await send(
                event("response.output_text.done", **ids, content_index=0, text=message.text)
            )
        part = {"type": kind, field_name: message.text}
        await send(event("response.content_part.done", **ids, content_index=0, part=part))
        await send(
            event(
                "response.output_item.done",
                response_id=self.id,
                output_index=message.output_index,
                item=message.item,
            )
        )
        if self._in_conversation:
            await send(event("conversation.item.done", item=message.item))

    async def _open_call(self, start: ToolCallStart) -> None:
        item = {
            "id": new_id("item"),
            "object": "realtime.item",
            "type": "function_call",
            "status": "in_progress",
            "call_id": start.id,
            "name": start.name,
            "arguments": "",
        }
        self._calls[start.index] = (item, len(self.output))  # open before the first await
        await self._add_output(item)

    async def _arguments(self, piece: ToolCallArguments) -> None:
        if piece.index not in self._calls or not piece.fragment:
            return
        item, index = self._calls[piece.index]
        item["arguments"] += piece.fragment
        await self.context.send(
            event(
                "response.function_call_arguments.delta",
                **self._ids(index, item["id"]),
                call_id=item["call_id"],
                delta=piece.fragment,
            )
        )

    async def _close_call(self, chat_index: int, status: str = "completed") -> None:
        if chat_index not in self._calls:
            return
        item, index = self._calls.pop(chat_index)
        item["status"] = status
        send = self.context.send
        await send(
            event(
                "response.function_call_arguments.done",
                **self._ids(index, item["id"]),
                call_id=item["call_id"],
                name=item["name"],
                arguments=item["arguments"],
            )
        )
        await send(
            event("response.output_item.done", response_id=self.id, output_index=index, item=item)
        )
        if self._in_conversation:
            await send(event("conversation.item.done", item=item))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """`response.done`'s usage: text tokens in and out (audio is not tokenized here)."""
    return {
        "total_tokens": prompt_tokens + completion_tokens,
        "input_tokens": prompt_tokens,
        "output_tokens": completion_tokens,
        "input_token_details": {
            "text_tokens": prompt_tokens,
            "audio_tokens": 0,
            "cached_tokens": 0,
        },
        "output_token_details": {"text_tokens": completion_tokens, "audio_tokens": 0},
    }


def refused(error: APIError) -> dict[str, Any]:
    """`status_details` of a response the server refused before generating."""
    return {
        "type": "failed",
        "error": {"type": error.type, "code": error.code, "message": error.message},
    }
