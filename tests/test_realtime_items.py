"""A Realtime session's conversation items without a server: `conversation.item.create` placed
by `previous_item_id` (after an item, `root` first, an unknown id refused), the items the
answer is built from in that order, `conversation.item.retrieve`, and input transcriptions
streamed as one delta per Whisper segment. Every server event is checked by the openai
SDK's models."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import numpy as np
from realtime_client import check_event

from mlxcel.engine.audio.transcribe import Segment, Transcription
from mlxcel.server.realtime.conversation import chat_turns
from mlxcel.server.realtime.session import RealtimeSession


class _Whisper:
    """Stands in for the audio worker: every transcription gives `segments`."""

    def __init__(self, segments: list[str]) -> None:
        self.segments = segments
        self.models = type("Models", (), {"tts": None})()

    def transcribe(self, audio: np.ndarray, options: object) -> Future[Transcription]:
        segments = [
            Segment(n, 0, n, n + 1, text, [], 0.0, 0.0, 1.0, 0.0)
            for n, text in enumerate(self.segments)
        ]
        done: Future[Transcription] = Future()
        done.set_result(
            Transcription("".join(self.segments).strip(), "en", 2.0, "transcribe", segments)
        )
        return done


def _session(segments: list[str] | None = None) -> tuple[RealtimeSession, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    async def send(event: dict[str, Any]) -> None:
        check_event(event)
        events.append(event)

    worker: Any = _Whisper(segments or [])
    session = RealtimeSession(
        None,
        None,
        worker,
        send,
        model="voice",
        max_audio_seconds=10.0,  # type: ignore[arg-type]
    )
    return session, events


def _text_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "input_text", "text": text}]
    return {"id": item_id, "type": "message", "role": "user", "content": content}


def test_created_items_go_after_previous_item_id_or_first_for_root() -> None:
    session, events = _session()

    async def scenario() -> None:
        for item_id, after in (("a", None), ("b", None), ("c", "a"), ("d", "root"), ("e", "b")):
            message: dict[str, Any] = {
                "type": "conversation.item.create",
                "item": _text_item(item_id, f"text {item_id}"),
            }
            if after is not None:
                message["previous_item_id"] = after
            await session.handle(message)

    asyncio.run(scenario())
    assert [i["id"] for i in session.items] == ["d", "a", "c", "b", "e"]
    added = [
        (e["item"]["id"], e["previous_item_id"]) for e in events if e["type"].endswith("added")
    ]
    assert added == [("a", None), ("b", "a"), ("c", "a"), ("d", None), ("e", "b")]
    done = [(e["item"]["id"], e["previous_item_id"]) for e in events if e["type"].endswith("done")]
    assert done == added
    # The answer reads the conversation in that order.
    turns = chat_turns("Be brief.", session.items)
    assert [t.message["content"] for t in turns[1:]] == [f"text {x}" for x in "dacbe"]


def test_unknown_previous_item_id_is_an_error_and_nothing_is_added() -> None:
    session, events = _session()

    async def scenario() -> None:
        await session.handle({"type": "conversation.item.create", "item": _text_item("a", "hi")})
        for after in ("nope", 7):
            await session.handle(
                {
                    "type": "conversation.item.create",
                    "event_id": "ev_1",
                    "previous_item_id": after,
                    "item": _text_item("b", "there"),
                }
            )

    asyncio.run(scenario())
    assert [i["id"] for i in session.items] == ["a"]
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["param"], e["event_id"]) for e in errors] == [("previous_item_id", "ev_1")] * 2
    assert "'nope' is not in the conversation" in errors[0]["message"]


def test_retrieve_gives_the_servers_item() -> None:
    session, events = _session()

    async def scenario() -> None:
        await session.handle({"type": "conversation.item.create", "item": _text_item("a", "hi")})
        await session.handle({"type": "conversation.item.retrieve", "item_id": "a"})
        await session.handle({"type": "conversation.item.retrieve", "item_id": "zz"})
        await session.handle({"type": "conversation.item.delete", "item_id": "a"})
        await session.handle({"type": "conversation.item.retrieve", "item_id": "a"})

    asyncio.run(scenario())
    retrieved = [e for e in events if e["type"] == "conversation.item.retrieved"]
    assert len(retrieved) == 1 and retrieved[0]["item"] == _session_item("a", "hi")
    assert [e["error"]["param"] for e in events if e["type"] == "error"] == ["item_id", "item_id"]


def _session_item(item_id: str, text: str) -> dict[str, Any]:
    """The server's representation of a created user text item."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


def test_input_transcription_streams_one_delta_per_segment() -> None:
    session, events = _session([" What is the capital", " of France?"])

    async def scenario() -> None:
        await session.handle({"type": "session.update", "session": {"turn_detection": None}})
        await session.handle(
            {"type": "input_audio_buffer.append", "audio": "AAAA" * 4000}  # 0.25 s of zeros
        )
        await session.handle({"type": "input_audio_buffer.commit"})
        while session.busy:
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    deltas = [
        e["delta"]
        for e in events
        if e["type"] == "conversation.item.input_audio_transcription.delta"
    ]
    completed = [
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    ]
    assert deltas == ["What is the capital", " of France?"]
    assert completed[0]["transcript"] == "".join(deltas) == "What is the capital of France?"
    assert session.items[0]["content"][0]["transcript"] == completed[0]["transcript"]


def _cancelled_while_sending(blocked: str) -> list[dict[str, Any]]:
    """The conversation after a text response is cancelled (as when its client leaves) while
    the event `blocked` is being sent, then `cancel` runs as the session's close does."""
    from contextlib import suppress

    from mlxcel.server.realtime.protocol import SessionConfig
    from mlxcel.server.realtime.response import RealtimeResponse, ResponseContext

    items: list[dict[str, Any]] = []

    async def scenario() -> None:
        reached, never = asyncio.Event(), asyncio.Event()

        async def send(event: dict[str, Any]) -> None:
            if event["type"] == blocked:
                reached.set()
                await never.wait()

        def add_item(item: dict[str, Any]) -> str | None:
            items.append(item)
            return None

        context = ResponseContext(
            state=None,  # type: ignore[arg-type]
            websocket=None,  # type: ignore[arg-type]
            worker=None,  # type: ignore[arg-type]
            send=send,
            items=items,
            add_item=add_item,
            conversation_id="conv_1",
            spoken={},
        )
        response = RealtimeResponse(context, SessionConfig(output_modalities=("text",)), "resp_1")

        async def answer() -> None:
            await response._text("Hello there.")
            await response._close_message()

        task = asyncio.ensure_future(answer())
        await asyncio.wait_for(reached.wait(), 5)
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        await response.cancel()

    asyncio.run(scenario())
    return items


def test_a_response_cancelled_mid_close_leaves_no_item_in_progress() -> None:
    (item,) = _cancelled_while_sending("response.output_text.done")
    assert item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello there."}]


def test_a_response_cancelled_while_its_item_is_announced_closes_it() -> None:
    (item,) = _cancelled_while_sending("conversation.item.added")
    assert item["status"] == "incomplete"
    assert item["content"] == [{"type": "output_text", "text": ""}]


def test_bad_out_of_band_responses_are_refused_before_they_start() -> None:
    session, events = _session()
    audio_part = {"type": "input_audio", "audio": "AAAA"}
    bad = [
        ({"conversation": "conv_other"}, "response.conversation"),
        ({"input": "nope"}, "response.input"),
        ({"input": [{"type": "item_reference", "id": "missing"}]}, "response.input[0]"),
        ({"input": [{"type": "message", "role": "user", "content": [audio_part]}]},
         "response.input[0]"),
        ({"input": [{"type": "message", "role": "robot", "content": []}]}, "response.input[0]"),
        ({"metadata": {str(n): "v" for n in range(17)}}, "response.metadata"),
        ({"metadata": {"k": 1}}, "response.metadata"),
        ({"metadata": {"k": "v" * 513}}, "response.metadata"),
    ]  # fmt: skip

    async def scenario() -> None:
        for response, _ in bad:
            await session.handle({"type": "response.create", "response": response})

    asyncio.run(scenario())
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [e["param"] for e in errors] == [param for _, param in bad]
    assert "'missing' is not in the conversation" in errors[2]["message"]
    assert "needs its `transcript`" in errors[3]["message"]
    assert not [e for e in events if e["type"] == "response.created"]
    assert session.response is None
