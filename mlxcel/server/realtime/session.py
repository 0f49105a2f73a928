"""A Realtime session's state machine: its configuration, input audio buffer, conversation,
transcriptions and (at most one) running response, driven by client events.

`handle` takes one decoded client event and answers through `send`; a refused event is
answered with an `error` event and the session goes on. Turns: with `server_vad`, speech
start and stop come from the buffer's detector, and the stop commits the turn (and starts
a response when `create_response`); with `turn_detection: null`, the client commits and asks
for responses. Speech starting while a response runs cancels it (barge-in): its message is
truncated to what was spoken. `close` cancels everything (the client went away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxcel.engine.errors import EngineError
from mlxcel.engine.voice.vad import SpeechStarted, SpeechStopped
from mlxcel.server.errors import APIError
from mlxcel.server.realtime.audio_wire import decode_audio, longer_than, to_whisper
from mlxcel.server.realtime.conversation import (
    MAX_CONVERSATION_CHARS,
    MAX_ITEMS,
    PendingAudio,
    item_chars,
    message_item,
    parse_item,
)
from mlxcel.server.realtime.input_buffer import InputAudioBuffer
from mlxcel.server.realtime.protocol import (
    ClientEventError,
    SessionConfig,
    apply_session_update,
    error_event,
    event,
    new_id,
    response_metadata,
    server_error_event,
)
from mlxcel.server.realtime.response import (
    RealtimeResponse,
    ResponseContext,
    SpokenSentence,
    refused,
)

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

    from mlxcel.engine.workers.audio import AudioWorker
    from mlxcel.server.state import ServerState

log = logging.getLogger(__name__)

MIN_COMMIT_MS = 100
"""A manual commit needs at least this much audio (OpenAI's rule)."""
TAIL_MS = 200
"""Audio kept after the detected end of speech (the word's fading end)."""
ROOT = "root"
"""`previous_item_id` that puts a created item first."""
MAX_TRANSCRIPTIONS = 4
"""Transcriptions a session has running or waiting at once (each holds its audio); a commit,
turn or audio item past them is refused."""

Send = Callable[[dict[str, Any]], Awaitable[None]]


class RealtimeSession:
    """One WebSocket's conversation."""

    def __init__(
        self,
        state: ServerState,
        websocket: WebSocket,
        worker: AudioWorker,
        send: Send,
        *,
        model: str,
        max_audio_seconds: float,
        speaker: AudioWorker | None = None,
    ) -> None:
        """`worker` transcribes and `speaker` speaks (by default `worker` does both; a router
        has Whisper and Kokoro in two models' workers)."""
        self.state = state
        self.websocket = websocket
        self.worker = worker
        self.speaker = speaker if speaker is not None else worker
        self.send = send
        self.model = model
        self.id = new_id("sess")
        self.conversation_id = new_id("conv")
        self.config = SessionConfig()
        self.buffer = InputAudioBuffer(
            self.config.input_format, max_audio_seconds, self.config.turn_detection
        )
        self.items: list[dict[str, Any]] = []
        self.spoken: dict[str, list[SpokenSentence]] = {}  # assistant audio items' sentences
        self.response: RealtimeResponse | None = None
        self._response_task: asyncio.Task[None] | None = None
        self._transcriptions: set[asyncio.Task[None]] = set()
        self._speech_item: str | None = None  # the item id of the speech being heard
        self._speech_start_ms = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Send `session.created`."""
        await self.send(event("session.created", session=self.config.wire(self.id, self.model)))

    @property
    def busy(self) -> bool:
        """Whether a response or a transcription is running (the session is not idle)."""
        return self._response_task is not None or bool(self._transcriptions)

    async def close(self) -> None:
        """Cancel the running response and transcriptions (the client is gone)."""
        task = self._response_task
        if task is not None and self.response is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(Exception):
                await self.response.cancel()
        for pending in list(self._transcriptions):
            pending.cancel()
        for pending in list(self._transcriptions):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending

    # ------------------------------------------------------------------ client events

    async def handle(self, message: dict[str, Any]) -> None:
        """Run one client event; an `error` event for a refused one."""
        client_id = message.get("event_id")
        client_id = client_id[:128] if isinstance(client_id, str) else None
        kind = message.get("type")
        handler = _HANDLERS.get(kind) if isinstance(kind, str) else None
        try:
            if handler is None:
                shown = str(kind)[:64] if isinstance(kind, str) else type(kind).__name__
                raise ClientEventError(
                    f"unknown or unsupported event type {shown!r}",
                    code="invalid_event",
                    param="type",
                )
            await handler(self, message)
        except ClientEventError as exc:
            await self.send(error_event(exc, client_id))
        except Exception:  # a server bug: said, logged, and the session goes on
            log.exception("realtime session %s: %s failed", self.id, kind)
            await self.send(server_error_event(f"the server failed on {kind}"))

    async def _session_update(self, message: dict[str, Any]) -> None:
        config = apply_session_update(self.config, message.get("session"))
        self._check_voice(config.voice)
        old, self.config = self.config, config
        if (old.input_format, old.turn_detection) != (config.input_format, config.turn_detection):
            self.buffer.configure(config.input_format, config.turn_detection)
            self._speech_item = None
        await self.send(event("session.updated", session=config.wire(self.id, self.model)))

    def _check_voice(self, voice: str) -> None:
        from mlxcel.engine.audio.tts import resolve_voice

        tts = self.speaker.models.tts
        if tts is None:
            return
        try:
            resolve_voice(tts, voice)
        except EngineError as exc:
            raise ClientEventError(str(exc), param="session.audio.output.voice") from None

    async def _append(self, message: dict[str, Any]) -> None:
        audio = message.get("audio")
        if not isinstance(audio, str):
            raise ClientEventError("audio must be a base64 string", param="audio")
        for turn in self.buffer.append(audio):
            if isinstance(turn, SpeechStarted):
                await self._speech_started(self.buffer.session_ms(turn))
            elif isinstance(turn, SpeechStopped):
                await self._speech_stopped(self.buffer.session_ms(turn))

    async def _speech_started(self, ms: int) -> None:
        self._speech_item = new_id("item")
        self._speech_start_ms = ms
        await self.send(
            event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=self._speech_item)
        )
        detection = self.config.turn_detection
        if detection is not None and detection.interrupt_response:
            await self.cancel_response("turn_detected")

    async def _speech_stopped(self, ms: int) -> None:
        item_id = self._speech_item or new_id("item")
        self._speech_item = None
        await self.send(
            event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id)
        )
        detection = self.config.turn_detection
        prefix = detection.prefix_padding_ms if detection else 0
        self._check_transcriptions()
        audio = self.buffer.take(self._speech_start_ms - prefix, ms + TAIL_MS)
        await self._commit(item_id, audio)
        if detection is not None and detection.create_response and self._response_task is None:
            await self._start_response(self.config)

    async def _commit_buffer(self, _message: dict[str, Any]) -> None:
        if self.buffer.ms < MIN_COMMIT_MS:
            raise ClientEventError(
                f"buffer too small: expected at least {MIN_COMMIT_MS} ms of audio,"
                f" but buffer only has {self.buffer.ms} ms",
                code="input_audio_buffer_commit_empty",
            )
        self._check_transcriptions()
        item_id = self._speech_item or new_id("item")
        self._speech_item = None
        audio = self.buffer.take()
        if self.buffer.detector is not None:
            self.buffer.detector.reset()
        await self._commit(item_id, audio)

    async def _clear_buffer(self, _message: dict[str, Any]) -> None:
        self.buffer.clear()
        self._speech_item = None
        await self.send(event("input_audio_buffer.cleared"))

    async def _commit(self, item_id: str, audio: np.ndarray) -> None:
        """A user item for `audio` (int16 at the input rate), transcribed in the background."""
        item = message_item("user", [{"type": "input_audio", "transcript": None}])
        item["id"] = item_id
        previous = self.add_item(item)
        await self.send(
            event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        )
        await self.send(event("conversation.item.added", previous_item_id=previous, item=item))
        self._transcribe(item, [(0, audio)])

    async def _item_create(self, message: dict[str, Any]) -> None:
        after = message.get("previous_item_id")
        if after is not None and not isinstance(after, str):
            raise ClientEventError("previous_item_id must be a string", param="previous_item_id")
        item, pending = parse_item(message.get("item"))
        if pending:
            self._check_transcriptions()
        decoded = [(p.content_index, self._decoded(p)) for p in pending]
        if any(i["id"] == item["id"] for i in self.items):
            raise ClientEventError(f"item id {item['id']!r} already exists", param="item.id")
        previous = self.add_item(item, after)
        await self.send(event("conversation.item.added", previous_item_id=previous, item=item))
        if decoded:
            self._transcribe(item, decoded)
        else:
            await self.send(event("conversation.item.done", previous_item_id=previous, item=item))

    def _decoded(self, pending: PendingAudio) -> np.ndarray:
        param = f"item.content[{pending.content_index}].audio"
        seconds = self.buffer.max_seconds
        if longer_than(pending.audio, self.config.input_format, seconds):
            raise ClientEventError(f"the audio is longer than {seconds:g} seconds", param=param)
        try:
            return decode_audio(pending.audio, self.config.input_format)
        except ClientEventError as exc:
            exc.param = param
            raise

    def _check_transcriptions(self) -> None:
        if len(self._transcriptions) >= MAX_TRANSCRIPTIONS:
            raise ClientEventError(
                f"{MAX_TRANSCRIPTIONS} transcriptions are already running; wait for one to end",
                code="too_many_transcriptions",
            )

    async def _item_retrieve(self, message: dict[str, Any]) -> None:
        item_id = message.get("item_id")
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None:
            raise ClientEventError("no item with that item_id", param="item_id")
        await self.send(event("conversation.item.retrieved", item=item))

    async def _item_delete(self, message: dict[str, Any]) -> None:
        item_id = message.get("item_id")
        found = [i for i in self.items if i["id"] == item_id]
        if not found:
            raise ClientEventError("no item with that item_id", param="item_id")
        self.items.remove(found[0])
        self.spoken.pop(found[0]["id"], None)
        await self.send(event("conversation.item.deleted", item_id=item_id))

    async def _item_truncate(self, message: dict[str, Any]) -> None:
        """Cut an assistant's spoken item to what the client played: its transcript keeps
        the sentences whose audio started before `audio_end_ms`."""
        item_id = message.get("item_id")
        item = next((i for i in self.items if i["id"] == item_id), None)
        if item is None or item_id not in self.spoken:
            raise ClientEventError("no assistant audio item with that item_id", param="item_id")
        if item.get("status") == "in_progress":
            raise ClientEventError("the item is still being answered", param="item_id")
        if message.get("content_index", 0) != 0:
            raise ClientEventError("content_index must be 0", param="content_index")
        end = message.get("audio_end_ms")
        sentences = self.spoken[item_id]
        total = int(sentences[-1].end_ms) if sentences else 0
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= total:
            raise ClientEventError(
                f"audio_end_ms must be an integer from 0 to the item's {total} ms of audio",
                param="audio_end_ms",
            )
        kept = [s for s in sentences if s.start_ms < end]
        self.spoken[item_id] = kept
        item["content"][0]["transcript"] = " ".join(s.text for s in kept)
        await self.send(
            event("conversation.item.truncated", item_id=item_id, content_index=0, audio_end_ms=end)
        )

    async def _response_create(self, message: dict[str, Any]) -> None:
        if self._response_task is not None:
            raise ClientEventError(
                "Conversation already has an active response in progress",
                code="conversation_already_has_active_response",
            )
        overrides = message.get("response")
        config = self.config
        if overrides is None:
            await self._start_response(config)
            return
        if not isinstance(overrides, dict):
            raise ClientEventError("response must be an object", param="response")
        fields = {
            k: v for k, v in overrides.items() if k not in ("conversation", "input", "metadata")
        }
        config = apply_session_update(config, {**fields, "type": "realtime"})
        self._check_voice(config.voice)
        conversation = overrides.get("conversation", "auto")
        if conversation not in ("auto", "none", None):
            raise ClientEventError(
                "response.conversation must be 'auto' or 'none'", param="response.conversation"
            )
        items = self._response_input(overrides.get("input"))
        metadata = response_metadata(overrides.get("metadata"))
        await self._start_response(config, items, conversation == "none", metadata)

    def _response_input(self, body: Any) -> list[dict[str, Any]] | None:
        """The items of `response.input` (None: the conversation), each a new item or an
        `item_reference` to one of the conversation's; audio parts need their transcript."""
        if body is None:
            return None
        if not isinstance(body, list) or len(body) > MAX_ITEMS:
            raise ClientEventError(
                f"response.input must be a list of at most {MAX_ITEMS} items",
                param="response.input",
            )
        items: list[dict[str, Any]] = []
        for index, entry in enumerate(body):
            where = f"response.input[{index}]"
            if isinstance(entry, dict) and entry.get("type") == "item_reference":
                wanted = entry.get("id")
                found = [i for i in self.items if i["id"] == wanted]
                if not found:
                    shown = str(wanted)[:64]
                    raise ClientEventError(
                        f"{where}: item {shown!r} is not in the conversation", param=where
                    )
                items.append(found[0])
                continue
            try:
                item, pending = parse_item(entry)
            except ClientEventError as exc:
                raise ClientEventError(f"{where}: {exc.message}", param=where) from None
            if pending:
                raise ClientEventError(
                    f"{where}: audio in response.input needs its `transcript`", param=where
                )
            items.append(item)
        if sum(item_chars(i) for i in items) > MAX_CONVERSATION_CHARS:
            raise ClientEventError(
                f"response.input holds more than {MAX_CONVERSATION_CHARS} characters",
                param="response.input",
            )
        return items

    async def _response_cancel(self, _message: dict[str, Any]) -> None:
        if not await self.cancel_response("client_cancelled"):
            raise ClientEventError(
                "Cancellation failed: no active response found",
                code="response_cancel_not_active",
            )

    # ------------------------------------------------------------------ items

    def add_item(self, item: dict[str, Any], after: str | None = None) -> str | None:
        """Put `item` after the item `after` (`root`: first; None: last), dropping the oldest
        others past MAX_ITEMS or MAX_CONVERSATION_CHARS; the id of the item before it. An
        unknown `after` is refused."""
        if after is None:
            at = len(self.items)
        elif after == ROOT:
            at = 0
        else:
            found = [n for n, i in enumerate(self.items) if i["id"] == after]
            if not found:
                raise ClientEventError(
                    f"previous_item_id {after[:64]!r} is not in the conversation",
                    param="previous_item_id",
                )
            at = found[0] + 1
        self.items.insert(at, item)
        chars = sum(item_chars(i) for i in self.items)
        while len(self.items) > 1 and (
            len(self.items) > MAX_ITEMS or chars > MAX_CONVERSATION_CHARS
        ):
            oldest = self.items.pop(1 if self.items[0] is item else 0)
            chars -= item_chars(oldest)
            self.spoken.pop(oldest["id"], None)
        at = self.items.index(item)  # the item before it may have been dropped
        return self.items[at - 1]["id"] if at else None

    def _transcribe(self, item: dict[str, Any], parts: list[tuple[int, np.ndarray]]) -> None:
        task = asyncio.ensure_future(self._transcription(item, parts))
        self._transcriptions.add(task)
        task.add_done_callback(self._transcriptions.discard)

    async def _transcription(
        self, item: dict[str, Any], parts: list[tuple[int, np.ndarray]]
    ) -> None:
        from mlxcel.engine.audio.transcribe import TranscriptionOptions
        from mlxcel.server.media.offload import off_loop

        fmt = self.config.input_format
        for index, audio in parts:
            future = None
            try:
                samples = await off_loop(to_whisper, audio, fmt)
                future = self.worker.transcribe(samples, TranscriptionOptions())
                result = await asyncio.wrap_future(future)
            except asyncio.CancelledError:
                if future is not None:
                    future.cancel()
                raise
            except Exception as exc:  # the worker's errors (queue full, timeout...), or a bug
                if not isinstance(exc, EngineError):
                    log.exception("realtime session %s: transcription failed", self.id)
                item["content"][index]["transcript"] = ""
                await self.send(
                    event(
                        "conversation.item.input_audio_transcription.failed",
                        item_id=item["id"],
                        content_index=index,
                        error={
                            "type": "transcription_error",
                            "code": None,
                            "message": str(exc),
                            "param": None,
                        },
                    )
                )
                continue
            text = result.text.strip()
            item["content"][index]["transcript"] = text
            ids = {"item_id": item["id"], "content_index": index}
            for delta in _segment_deltas(text, [seg.text for seg in result.segments]):
                await self.send(
                    event("conversation.item.input_audio_transcription.delta", **ids, delta=delta)
                )
            await self.send(
                event(
                    "conversation.item.input_audio_transcription.completed",
                    **ids,
                    transcript=text,
                    usage={"type": "duration", "seconds": round(result.duration, 3)},
                )
            )
        await self.send(event("conversation.item.done", item=item))

    # ------------------------------------------------------------------ responses

    async def _start_response(
        self,
        config: SessionConfig,
        items: list[dict[str, Any]] | None = None,
        out_of_band: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Start a response from `items` (None: the conversation); an `out_of_band` one adds
        nothing to the conversation."""
        context = ResponseContext(
            state=self.state,
            websocket=self.websocket,
            worker=self.speaker,
            send=self.send,
            items=self.items if items is None else items,
            add_item=self.add_item,
            conversation_id=None if out_of_band else self.conversation_id,
            spoken=self.spoken,
        )
        response = RealtimeResponse(context, config, new_id("resp"), metadata)
        self.response = response
        await self.send(event("response.created", response=response.wire("in_progress")))
        self._response_task = asyncio.ensure_future(self._respond(response))

    async def _respond(self, response: RealtimeResponse) -> None:
        try:
            pending = list(self._transcriptions)
            if pending:  # the answer needs the user's words (a cancelled answer still gets them)
                await asyncio.wait(pending)
            try:
                status, details = await response.run()
            except APIError as exc:
                status, details = "failed", refused(exc)
                await self.send(server_error_event(exc.message, exc.type, exc.code))
            except EngineError as exc:
                status, details = "failed", _failed("server_error", str(exc))
                await self.send(server_error_event(str(exc)))
            except Exception:  # a server bug: the answer fails, the session goes on
                log.exception("realtime session %s: response %s failed", self.id, response.id)
                status, details = "failed", _failed("server_error", "the response failed")
                await self.send(server_error_event("the response failed"))
            await self.send(event("response.done", response=response.wire(status, details)))
        finally:
            if self.response is response:
                self.response, self._response_task = None, None

    async def cancel_response(self, reason: str) -> bool:
        """Cancel the running response (`turn_detected`, `client_cancelled`); False if none."""
        task, response = self._response_task, self.response
        if task is None or response is None:
            return False
        self._response_task, self.response = None, None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await response.cancel()
        details = {"type": "cancelled", "reason": reason}
        await self.send(event("response.done", response=response.wire("cancelled", details)))
        return True


def _segment_deltas(text: str, segments: list[str]) -> list[str]:
    """A transcript as one delta per Whisper segment (they join to `text` exactly); the
    whole text as one delta when the segments do not add up to it."""
    deltas = [piece for piece in segments if piece]
    if deltas:
        deltas[0] = deltas[0].lstrip()
        deltas[-1] = deltas[-1].rstrip()
    return deltas if "".join(deltas) == text and all(deltas) else [text]


def _failed(kind: str, message: str) -> dict[str, Any]:
    """`status_details` of a failed response."""
    return {"type": "failed", "error": {"type": kind, "message": message}}


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession._session_update,
    "input_audio_buffer.append": RealtimeSession._append,
    "input_audio_buffer.commit": RealtimeSession._commit_buffer,
    "input_audio_buffer.clear": RealtimeSession._clear_buffer,
    "conversation.item.create": RealtimeSession._item_create,
    "conversation.item.delete": RealtimeSession._item_delete,
    "conversation.item.retrieve": RealtimeSession._item_retrieve,
    "conversation.item.truncate": RealtimeSession._item_truncate,
    "response.create": RealtimeSession._response_create,
    "response.cancel": RealtimeSession._response_cancel,
}
"""Client events by type (the beta names are the same for these)."""
