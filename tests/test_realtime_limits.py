"""A Realtime session's bounds against a hostile client, without a server: transcriptions
at once (each holds its audio; a client that vanishes cancels them and their worker jobs),
an audio item's length, and the text a conversation keeps. Every server event is checked by
the openai SDK's models."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
from realtime_client import check_event

from mlxcel.engine.audio.transcribe import Transcription
from mlxcel.engine.text.request import GenerationEvent
from mlxcel.server.realtime import response as response_module
from mlxcel.server.realtime.conversation import (
    MAX_CONVERSATION_CHARS,
    MAX_TEXT_CHARS,
    item_chars,
)
from mlxcel.server.realtime.session import MAX_TRANSCRIPTIONS, RealtimeSession


class _StuckWhisper:
    """Stands in for the audio worker: transcriptions that never end (a busy worker)."""

    def __init__(self) -> None:
        self.futures: list[Future[Any]] = []
        self.models = type("Models", (), {"tts": None})()

    def transcribe(self, audio: np.ndarray, options: object) -> Future[Any]:
        future: Future[Any] = Future()
        self.futures.append(future)
        return future


def _session(max_audio_seconds: float = 2.0) -> tuple[RealtimeSession, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    async def send(event: dict[str, Any]) -> None:
        check_event(event)
        events.append(event)

    worker: Any = _StuckWhisper()
    session = RealtimeSession(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        worker,
        send,
        model="voice",
        max_audio_seconds=max_audio_seconds,
    )
    return session, events


def _audio_item(seconds: float) -> dict[str, Any]:
    audio = base64.b64encode(bytes(int(24_000 * seconds) * 2)).decode("ascii")
    return {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_audio", "audio": audio}],
    }


def _errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if e["type"] == "error"]


def test_transcriptions_at_once_are_bounded_and_a_gone_client_cancels_them() -> None:
    session, events = _session()
    worker: Any = session.worker

    async def scenario() -> None:
        for _ in range(MAX_TRANSCRIPTIONS + 3):
            await session.handle({"type": "conversation.item.create", "item": _audio_item(0.5)})
        await session.handle({"type": "session.update", "session": {"turn_detection": None}})
        await session.handle(
            {"type": "input_audio_buffer.append", "audio": _audio_item(0.5)["content"][0]["audio"]}
        )
        await session.handle({"type": "input_audio_buffer.commit"})
        while len(worker.futures) < MAX_TRANSCRIPTIONS:  # resampled off the loop first
            await asyncio.sleep(0.01)
        assert session.buffer.ms == 500  # a refused commit keeps its audio
        await session.close()

    asyncio.run(scenario())
    codes = [e["code"] for e in _errors(events)]
    assert codes == ["too_many_transcriptions"] * 4
    assert len(session.items) == MAX_TRANSCRIPTIONS
    assert len(worker.futures) == MAX_TRANSCRIPTIONS
    assert all(f.cancelled() for f in worker.futures)
    assert not session.busy


def test_an_audio_item_longer_than_the_buffer_cap_is_refused() -> None:
    session, events = _session(max_audio_seconds=2.0)

    async def scenario() -> None:
        await session.handle({"type": "conversation.item.create", "item": _audio_item(2.5)})
        await session.handle({"type": "conversation.item.create", "item": _audio_item(1.5)})
        await session.close()

    asyncio.run(scenario())
    errors = _errors(events)
    assert [e["param"] for e in errors] == ["item.content[0].audio"]
    assert "longer than 2 seconds" in errors[0]["message"]
    assert len(session.items) == 1


def _text_item(item_id: str, chars: int) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "x" * chars}],
    }


def test_the_conversation_keeps_a_bounded_amount_of_text() -> None:
    session, events = _session()
    many = MAX_CONVERSATION_CHARS // MAX_TEXT_CHARS + 2

    async def scenario() -> None:
        for n in range(many):
            await session.handle(
                {"type": "conversation.item.create", "item": _text_item(f"i{n}", MAX_TEXT_CHARS)}
            )
        # One placed first stays: the oldest others make room for it.
        await session.handle(
            {
                "type": "conversation.item.create",
                "previous_item_id": "root",
                "item": _text_item("first", MAX_TEXT_CHARS),
            }
        )
        # One placed after the oldest, which then makes room: it is said to come first.
        await session.handle(
            {
                "type": "conversation.item.create",
                "previous_item_id": "first",
                "item": _text_item("second", MAX_TEXT_CHARS),
            }
        )
        # One item larger than the whole budget, in many parts, is refused.
        huge = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "y" * MAX_TEXT_CHARS}] * 64,
        }
        await session.handle({"type": "conversation.item.create", "item": huge})

    asyncio.run(scenario())
    assert sum(item_chars(i) for i in session.items) <= MAX_CONVERSATION_CHARS
    ids = [i["id"] for i in session.items]
    assert ids[0] == "second" and ids[1] == "i3" and ids[-1] == f"i{many - 1}"
    added = [e for e in events if e["type"] == "conversation.item.added"]
    assert (added[-1]["item"]["id"], added[-1]["previous_item_id"]) == ("second", None)
    assert [e["param"] for e in _errors(events)] == ["item.content"]


def test_a_response_cancelled_while_it_waits_leaves_the_transcription_running() -> None:
    session, events = _session()
    worker: Any = session.worker

    async def scenario() -> None:
        await session.handle({"type": "session.update", "session": {"turn_detection": None}})
        await session.handle(
            {"type": "input_audio_buffer.append", "audio": _audio_item(0.5)["content"][0]["audio"]}
        )
        await session.handle({"type": "input_audio_buffer.commit"})
        await session.handle({"type": "response.create"})  # waits for the user's words
        while not worker.futures:
            await asyncio.sleep(0.01)
        await session.handle({"type": "response.cancel"})  # a barge-in, say
        worker.futures[0].set_result(Transcription("Hello there.", "en", 0.5, "transcribe", []))
        while session.busy:
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    done = [e for e in events if e["type"] == "response.done"]
    assert [e["response"]["status"] for e in done] == ["cancelled"]
    completed = [
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    assert [e["transcript"] for e in completed] == ["Hello there."]
    assert session.items[0]["content"][0]["transcript"] == "Hello there."


class _FailingSplitter:
    """An output splitter with a bug: it raises on the answer's first text."""

    def feed(self, text: str) -> list[Any]:
        raise RuntimeError("splitter bug")

    def finish(self) -> list[Any]:
        return []


class _FailingChatCore:
    """Admits every request; its answer's text breaks the splitter."""

    closed = 0

    def __init__(self, state: object) -> None:
        pass

    async def start(self, request: object, raw: object) -> Any:
        async def stream() -> Any:
            yield GenerationEvent(request_id="r", text="Hello there. ")

        class Job:
            request = type("Request", (), {"request_id": "r"})()

            def close(self) -> None:
                _FailingChatCore.closed += 1

        plan = type("Plan", (), {"stream": lambda self, request_id: _FailingSplitter()})()
        return type("Admitted", (), {"plan": plan, "stream": stream(), "job": Job()})()


def test_a_response_that_fails_leaves_no_task_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(response_module, "ChatCore", _FailingChatCore)
    session, events = _session()

    async def scenario() -> set[asyncio.Task[Any]]:
        await session.handle({"type": "response.create"})
        while session.busy:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return asyncio.all_tasks() - {asyncio.current_task()}  # type: ignore[operator]

    left = asyncio.run(scenario())
    assert not left, left
    done = [e for e in events if e["type"] == "response.done"]
    assert [e["response"]["status"] for e in done] == ["failed"]
    assert _FailingChatCore.closed == 1
