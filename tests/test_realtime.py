"""`/v1/realtime` end to end: a real `mlxcel serve` with SmolLM2 (the chat model, greedy),
the shipped Whisper tiny.en and the tiny Kokoro fixture, driven by the official openai
SDK's realtime client and by a plain `websockets` client. Every server event is checked
against the SDK's own event models.

Speech is Piper's reading of "The quick brown fox jumps over the lazy dog."; Whisper must
transcribe it word for word. The template is a Qwen-style one (tools rendered, `<tool_call>`
JSON) so that a forced tool choice makes a real function call through the grammar.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets
from fixtures.audio import SENTENCE, normalized_words, require_shipped_whisper, tiny_kokoro_dir
from realtime_client import (
    Client,
    b64,
    check_event,
    connect,
    silence_pcm,
    speech_pcm,
    ws_url,
)
from server_harness import API_KEY, ServeProcess
from test_server_tools import QWEN_STYLE_TEMPLATE, THINKING_OPT_IN

from mlxcel.engine.voice.sentences import SentenceChunker
from mlxcel.server.realtime.conversation import MAX_CONVERSATION_CHARS, MAX_TEXT_CHARS
from mlxcel.server.realtime.session import MAX_TRANSCRIPTIONS

WHISPER = require_shipped_whisper()

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = [
        "-m",
        str(smollm2_gguf),
        "--audio-model",
        "default",
        "--tts-model",
        str(tiny_kokoro_dir()),
        "--api-key",
        API_KEY,
        "-c",
        "4096",
        "--temp",
        "0",
        "--chat-template-file",
        str(template),
        "--chat-template-kwargs",
        json.dumps(THINKING_OPT_IN),
        "--realtime-max-sessions",
        "2",
        "--realtime-idle-timeout",
        "8",
    ]
    with ServeProcess(args) as running:
        yield running


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def _audio_bytes(client: Client) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in client.of("response.output_audio.delta"))


def _transcript(client: Client) -> str:
    return "".join(e["delta"] for e in client.of("response.output_audio_transcript.delta"))


# ------------------------------------------------------------------ the openai SDK


def test_sdk_manual_turn_is_transcribed_and_answered_in_streamed_speech(
    server: ServeProcess,
) -> None:
    from openai import AsyncOpenAI

    async def scenario() -> tuple[list[dict[str, Any]], float, float]:
        sdk = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        events: list[dict[str, Any]] = []
        async with sdk.realtime.connect(model="voice") as conn:

            async def until(kind: str) -> None:
                while True:
                    raw = await asyncio.wait_for(conn.recv_bytes(), 180)
                    event = json.loads(raw)
                    check_event(event)
                    assert conn.parse_event(raw).type == event["type"]  # the SDK reads it
                    events.append(event)
                    if event["type"] == kind:
                        return

            await until("session.created")
            session = {**MANUAL, "max_output_tokens": 400}
            await conn.session.update(session=session)  # type: ignore[arg-type]
            await until("session.updated")
            await conn.input_audio_buffer.append(audio=b64(speech_pcm()))
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            started = time.perf_counter()
            await until("response.done")
            answer = events[-1]["response"]["output"][0]["id"]
            # The client played 1 ms of it: only the first sentence stays in the item.
            probe = {"output_modalities": ["text"], "max_output_tokens": 1}
            await conn.response.create(response=probe)  # type: ignore[arg-type]
            await until("response.done")
            await conn.conversation.item.truncate(
                item_id=answer, content_index=0, audio_end_ms=10**7
            )
            await until("error")
            await conn.conversation.item.truncate(item_id=answer, content_index=0, audio_end_ms=1)
            await until("conversation.item.truncated")
            await conn.response.create(response=probe)  # type: ignore[arg-type]
            await until("response.done")
            finished = time.perf_counter()
            await conn.conversation.item.retrieve(item_id=answer)
            await until("conversation.item.retrieved")
            content = [{"type": "input_text", "text": "Be brief."}]
            note = {"type": "message", "role": "system", "content": content}
            await conn.conversation.item.create(item=note, previous_item_id="root")  # type: ignore[arg-type]
            await until("conversation.item.done")
            return events, started, finished

    events, _, _ = run(scenario())
    _, full, cut = (
        e["response"]["usage"]["input_tokens"] for e in events if e["type"] == "response.done"
    )
    assert cut < full - 10
    assert [e["error"]["param"] for e in events if e["type"] == "error"] == ["audio_end_ms"]
    # The SDK's retrieve gives the truncated item; its create puts a note first ("root").
    retrieved = next(e for e in events if e["type"] == "conversation.item.retrieved")["item"]
    first_done = next(i for i, e in enumerate(events) if e["type"] == "response.done")
    spoken = "".join(
        e["delta"]
        for e in events[:first_done]
        if e["type"] == "response.output_audio_transcript.delta"
    )
    kept = retrieved["content"][0]["transcript"]
    assert retrieved["id"] == events[first_done]["response"]["output"][0]["id"]
    assert kept and len(kept) < len(spoken.strip()) and spoken.strip().startswith(kept)
    added = [e for e in events if e["type"] == "conversation.item.added"][-1]
    assert added["previous_item_id"] is None and added["item"]["role"] == "system"
    events = events[: next(i for i, e in enumerate(events) if e["type"] == "response.done") + 1]
    kinds = [e["type"] for e in events]
    completed = next(
        e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
    )
    assert normalized_words(completed["transcript"]) == normalized_words(SENTENCE)
    deltas = [e for e in events if e["type"].endswith("input_audio_transcription.delta")]
    assert "".join(e["delta"] for e in deltas) == completed["transcript"]  # one per segment
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert completed["item_id"] == committed["item_id"]
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["usage"]["input_tokens"] > 0 and done["usage"]["output_tokens"] > 0
    transcript = "".join(
        e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"
    )
    assert transcript.strip() == done["output"][0]["content"][0]["transcript"]
    assert len(transcript.split()) > 30  # a long answer of several sentences
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    assert len(audio) > 0 and len(audio) % 2 == 0
    order = [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.done",
    ]
    assert [k for k in kinds if k in order] == order


# ------------------------------------------------------------------ plain websockets


def test_first_sentence_is_spoken_while_the_answer_streams(server: ServeProcess) -> None:
    async def scenario() -> tuple[Client, int, str]:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            audio = {"input": {"turn_detection": None}, "output": {"speed": 2.0}}
            session = {"type": "realtime", "max_output_tokens": 500, "audio": audio}
            await client.send("session.update", session=session)
            await client.until("session.updated")
            text = "Tell me a long story about a fox and a dog, in twenty sentences."
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": text}],
            }
            await client.send("conversation.item.create", item=item)
            await client.send("response.create")
            await client.until("response.output_audio.delta")
            first_audio = len(client.events) - 1
            ends = ("response.output_audio_transcript.done", "response.done")
            following = await client.recv()
            while following["type"] not in (*ends, "response.output_audio_transcript.delta"):
                following = await client.recv()
            await client.send("response.cancel")
            await client.until("response.done")
            return client, first_audio, following["type"]

    client, first_audio, following = run(scenario())
    assert following == "response.output_audio_transcript.delta"  # the text was streaming
    before = "".join(
        e["delta"]
        for e in client.events[:first_audio]
        if e["type"] == "response.output_audio_transcript.delta"
    )
    # The audio of the first sentence came once that sentence was complete, not the answer.
    assert SentenceChunker().feed(before)
    done = client.of("response.done")[0]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}


async def _text_session(ws: Any) -> Client:
    """A client on a manual-turn, text-only session answering in at most 24 tokens."""
    client = Client(ws)
    await client.until("session.created")
    await client.send(
        "session.update",
        session={**MANUAL, "output_modalities": ["text"], "max_output_tokens": 24},
    )
    await client.until("session.updated")
    return client


def _user_text(text: str, **fields: Any) -> dict[str, Any]:
    return {
        **fields,
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
    }


def test_text_session_streams_output_text(server: ServeProcess) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = await _text_session(ws)
            item = _user_text("What is the capital of France?")
            await client.send("conversation.item.create", item=item)
            await client.until("conversation.item.done")
            await client.send("response.create")
            await client.until("response.done")
            return client

    client = run(scenario())
    text = "".join(e["delta"] for e in client.of("response.output_text.delta"))
    assert "Paris" in text
    assert client.of("response.output_audio.delta") == []
    done = client.of("response.done")[0]["response"]
    assert done["output"][0]["content"][0] == {"type": "output_text", "text": text}
    assert done["usage"]["output_tokens"] <= 24


def test_out_of_band_response_answers_its_own_input_and_leaves_the_conversation_alone(
    server: ServeProcess,
) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = await _text_session(ws)
            item = _user_text("Hello, I am planning a trip.", id="item_greeting")
            await client.send("conversation.item.create", item=item)
            await client.until("conversation.item.done")
            question = _user_text("What is the capital of France?")
            await client.send(
                "response.create",
                response={
                    "conversation": "none",
                    "input": [{"type": "item_reference", "id": "item_greeting"}, question],
                    "metadata": {"purpose": "side-question"},
                },
            )
            done = await client.until("response.done")
            answer_id = done["response"]["output"][0]["id"]
            await client.send("conversation.item.retrieve", item_id=answer_id)
            await client.until("error")
            return client

    client = run(scenario())
    text = "".join(e["delta"] for e in client.of("response.output_text.delta"))
    assert "Paris" in text
    done = client.of("response.done")[0]["response"]
    assert done["conversation_id"] is None
    assert done["metadata"] == {"purpose": "side-question"}
    assert done["output"][0]["status"] == "completed"
    assert client.of("response.output_item.added") and client.of("response.output_item.done")
    added = [e["item"]["id"] for e in client.of("conversation.item.added")]
    assert added == ["item_greeting"]  # the answer was not added to the conversation
    assert [e["item"]["id"] for e in client.of("conversation.item.done")] == ["item_greeting"]
    assert client.of("error")[0]["error"]["param"] == "item_id"


def test_g711_in_and_out_and_an_audio_item(server: ServeProcess) -> None:
    from mlxcel.engine.audio.codec import resample
    from mlxcel.engine.voice.g711 import alaw_decode, ulaw_encode

    pcm = np.frombuffer(speech_pcm(), dtype="<i2").astype(np.float32) / 32768.0
    ulaw = ulaw_encode((resample(pcm, 24_000, 8_000) * 32767).astype(np.int16))

    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            audio = {
                "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                "output": {"format": {"type": "audio/pcma"}},
            }
            session = {"type": "realtime", "audio": audio, "max_output_tokens": 12}
            await client.send("session.update", session=session)
            await client.until("session.updated")
            content = [{"type": "input_audio", "audio": b64(ulaw)}]
            await client.send(
                "conversation.item.create",
                item={"type": "message", "role": "user", "content": content},
            )
            await client.until("conversation.item.done")
            await client.send("response.create")
            await client.until("response.done")
            return client

    client = run(scenario())
    transcript = client.of("conversation.item.input_audio_transcription.completed")[0]
    assert normalized_words(transcript["transcript"]) == normalized_words(SENTENCE)
    item = client.of("conversation.item.done")[0]["item"]
    assert item["content"][0]["transcript"] == transcript["transcript"]
    audio = _audio_bytes(client)
    assert audio and np.abs(alaw_decode(audio).astype(np.int32)).max() > 100
    done = client.of("response.done")[0]["response"]
    assert done["audio"]["output"]["format"] == {"type": "audio/pcma"}


def test_server_vad_commits_on_silence_and_answers(server: ServeProcess) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            # The default session: server_vad, answers in speech.
            await client.send(
                "session.update", session={"type": "realtime", "max_output_tokens": 20}
            )
            await client.until("session.updated")
            await client.speak(silence_pcm(0.6) + speech_pcm() + silence_pcm(1.0))
            await client.until("response.done")
            return client

    client = run(scenario())
    started = client.of("input_audio_buffer.speech_started")[0]
    stopped = client.of("input_audio_buffer.speech_stopped")[0]
    speech_ms = len(speech_pcm()) // 48
    assert 500 <= started["audio_start_ms"] <= 800
    assert abs(stopped["audio_end_ms"] - (600 + speech_ms)) < 250
    assert (
        started["item_id"]
        == stopped["item_id"]
        == client.of("input_audio_buffer.committed")[0]["item_id"]
    )
    transcript = client.of("conversation.item.input_audio_transcription.completed")[0]
    assert normalized_words(transcript["transcript"]) == normalized_words(SENTENCE)
    assert client.index("input_audio_buffer.speech_stopped") < client.index("response.created")
    assert client.of("response.done")[0]["response"]["status"] in ("completed", "incomplete")
    assert _audio_bytes(client)


def test_barge_in_cancels_and_truncates_the_answer(server: ServeProcess) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            await client.send(
                "session.update", session={"type": "realtime", "max_output_tokens": 300}
            )
            await client.until("session.updated")
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a long story about a fox."}],
            }
            await client.send("conversation.item.create", item=item)
            await client.send("response.create")
            await client.until("response.output_audio_transcript.delta")
            await client.speak(speech_pcm())  # the user talks over the answer
            await client.until("response.done")
            return client

    client = run(scenario())
    done = client.of("response.done")[0]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert client.index("input_audio_buffer.speech_started") < client.index("response.done")
    truncated = client.of("conversation.item.truncated")[0]
    message = done["output"][0]
    assert truncated["item_id"] == message["id"] and message["status"] == "incomplete"
    # What stays in the conversation is what was spoken (maybe nothing yet), not the text
    # the model had generated.
    spoken = message["content"][0]["transcript"]
    assert len(spoken) <= len(_transcript(client).strip())
    assert truncated["audio_end_ms"] == pytest.approx(len(_audio_bytes(client)) / 48, abs=1)


def test_function_call_round_trip(server: ServeProcess) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            session = {
                **MANUAL,
                "output_modalities": ["text"],
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "max_output_tokens": 60,
            }
            await client.send("session.update", session=session)
            await client.until("session.updated")
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
            }
            await client.send("conversation.item.create", item=item)
            await client.send("response.create")
            await client.until("response.done")
            call = client.of("response.function_call_arguments.done")[0]
            output = {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": '{"sky": "sunny", "celsius": 21}',
            }
            await client.send("conversation.item.create", item=output)
            await client.until("conversation.item.done")
            answer = {"tool_choice": "none", "max_output_tokens": 30}
            await client.send("response.create", response=answer)
            await client.until("response.done")
            # Without the output item (and the answer to it), the same request has a
            # shorter prompt.
            answered = client.of("response.done")[-1]["response"]["output"][0]["id"]
            output_id = next(
                e["item"]["id"]
                for e in client.of("conversation.item.added")
                if e["item"]["type"] == "function_call_output"
            )
            for item_id in (answered, output_id):
                await client.send("conversation.item.delete", item_id=item_id)
                await client.until("conversation.item.deleted")
            await client.send("response.create", response=answer)
            await client.until("response.done")
            return client

    client = run(scenario())
    call = client.of("response.function_call_arguments.done")[0]
    assert call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])
    assert isinstance(arguments.get("city"), str)
    deltas = [
        e
        for e in client.of("response.function_call_arguments.delta")
        if e["call_id"] == call["call_id"]
    ]
    assert "".join(e["delta"] for e in deltas) == call["arguments"]
    first, second, third = (e["response"] for e in client.of("response.done"))
    assert first["output"][0]["type"] == "function_call"
    assert first["output"][0]["call_id"] == call["call_id"]
    assert second["status"] in ("completed", "incomplete")
    assert second["output"][0]["type"] == "message"
    # The second prompt held the call's output: 12 tokens or so more than without it.
    assert second["usage"]["input_tokens"] > third["usage"]["input_tokens"] + 5


def test_bad_events_get_error_events_and_the_session_lives(server: ServeProcess) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            await ws.send(b"\x00\x01binary")
            await ws.send("{not json")
            await ws.send("[1, 2]")
            await client.send("no.such.event", event_id="evt_1")
            await client.send("input_audio_buffer.append", audio=12)
            await client.send("input_audio_buffer.append", audio="@@@not base64@@@")
            await client.send("input_audio_buffer.append", audio=b64(b"\x01\x02\x03"))
            await client.send("input_audio_buffer.append", audio=b64(silence_pcm(121.0)))
            await client.send(
                "session.update",
                session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            )
            await client.send(
                "session.update",
                session={"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            )
            await client.send("session.update", session={"audio": {"output": {"voice": "nobody"}}})
            await client.send("session.update", session={"tools": "all"})
            await client.send(
                "conversation.item.create",
                item={"type": "message", "role": "user", "content": "hi"},
            )
            await client.send("input_audio_buffer.commit")
            await client.send("response.cancel")
            for _ in range(15):
                await client.until("error")
            # Still alive: G.711 µ-law in, manual turns.
            await client.send(
                "session.update",
                session={
                    **MANUAL,
                    "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}},
                },
            )
            await client.until("session.updated")
            return client

    client = run(scenario())
    errors = [e["error"] for e in client.of("error")]
    codes = [e["code"] for e in errors]
    assert codes[:4] == ["invalid_event", "invalid_json", "invalid_event", "invalid_event"]
    assert errors[3]["event_id"] == "evt_1"
    assert codes[7] == "input_audio_buffer_full"
    assert codes[13:] == ["input_audio_buffer_commit_empty", "response_cancel_not_active"]
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
    updated = client.of("session.updated")[0]["session"]
    assert updated["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert updated["audio"]["input"]["turn_detection"] is None


def test_a_flooding_client_is_bounded_and_the_session_lives(server: ServeProcess) -> None:
    """Audio items faster than Whisper: past MAX_TRANSCRIPTIONS refused (each held its
    audio); an audio item past the buffer's 120 s cap refused; the conversation's text
    bounded (the oldest items go)."""
    speech = speech_pcm()

    def audio_item(pcm: bytes) -> dict[str, Any]:
        return {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": b64(pcm)}],
        }

    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            await client.send("session.update", session=MANUAL)
            await client.send("conversation.item.create", item=audio_item(silence_pcm(121.0)))
            for _ in range(MAX_TRANSCRIPTIONS + 4):
                await client.send("conversation.item.create", item=audio_item(speech))
            for n in range(MAX_CONVERSATION_CHARS // MAX_TEXT_CHARS + 2):
                text = [{"type": "input_text", "text": "x" * MAX_TEXT_CHARS}]
                item = {"id": f"t{n}", "type": "message", "role": "user", "content": text}
                await client.send("conversation.item.create", item=item)
            await client.send("conversation.item.retrieve", item_id="t0")
            await client.send("conversation.item.retrieve", item_id="t2")
            await client.until("conversation.item.retrieved")
            while len(client.of("conversation.item.input_audio_transcription.completed")) < len(
                client.of("conversation.item.added")
            ) - (MAX_CONVERSATION_CHARS // MAX_TEXT_CHARS + 2):
                await client.recv()
            return client

    client = run(scenario())
    codes = [e["error"]["code"] for e in client.of("error")]
    params = [e["error"]["param"] for e in client.of("error")]
    refused = codes.count("too_many_transcriptions")
    assert refused >= 1 and "item.content[0].audio" in params
    assert params.count("item_id") == 1  # t0 is gone, t2 is kept
    assert client.of("conversation.item.retrieved")[0]["item"]["id"] == "t2"
    transcripts = client.of("conversation.item.input_audio_transcription.completed")
    assert len(transcripts) == MAX_TRANSCRIPTIONS + 4 - refused
    assert all(normalized_words(e["transcript"]) == normalized_words(SENTENCE) for e in transcripts)


def test_cancelling_an_answer_that_waits_for_whisper_keeps_the_transcription(
    server: ServeProcess,
) -> None:
    async def scenario() -> Client:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            await client.send("session.update", session=MANUAL)
            await client.speak(speech_pcm())
            await client.send("input_audio_buffer.commit")
            await client.send("response.create")
            await client.send("response.cancel")  # while the answer waits for the words
            await client.until("response.done")
            await client.until("conversation.item.input_audio_transcription.completed")
            return client

    client = run(scenario())
    assert [e["response"]["status"] for e in client.of("response.done")] == ["cancelled"]
    (done,) = client.of("conversation.item.input_audio_transcription.completed")
    assert normalized_words(done["transcript"]) == normalized_words(SENTENCE)
    assert not client.of("conversation.item.input_audio_transcription.failed")


# ------------------------------------------------------------------ access and limits


def test_auth_by_header_or_subprotocol(server: ServeProcess) -> None:
    async def status(**kwargs: Any) -> int | None:
        try:
            async with websockets.connect(ws_url(server.url), **kwargs) as ws:
                event = json.loads(await ws.recv())
                assert event["type"] == "session.created"
                assert kwargs.get("subprotocols") is None or ws.subprotocol == "realtime"
                return None
        except websockets.InvalidStatus as exc:
            body = json.loads(exc.response.body or b"{}")
            assert body["error"]["type"] in ("missing_api_key", "invalid_api_key")
            return int(exc.response.status_code)

    async def scenario() -> list[int | None]:
        return [
            await status(),
            await status(additional_headers={"Authorization": "Bearer wrong"}),
            await status(subprotocols=["realtime", "openai-insecure-api-key.wrong"]),
            await status(additional_headers={"Authorization": f"Bearer {API_KEY}"}),
            await status(subprotocols=["realtime", f"openai-insecure-api-key.{API_KEY}"]),
        ]

    assert run(scenario()) == [401, 401, 401, None, None]


def test_sessions_past_the_limit_are_closed_with_1013(server: ServeProcess) -> None:
    async def opened(stack: contextlib.AsyncExitStack) -> Any:
        """A session that got `session.created` (an earlier test's may still be ending)."""
        for _ in range(50):
            ws = await stack.enter_async_context(connect(ws_url(server.url), API_KEY))
            try:
                assert json.loads(await ws.recv())["type"] == "session.created"
                return ws
            except websockets.ConnectionClosed:
                await asyncio.sleep(0.2)
        raise AssertionError("no session was accepted")

    async def scenario() -> tuple[int | None, str]:
        async with contextlib.AsyncExitStack() as stack:
            await opened(stack)
            await opened(stack)
            three = await stack.enter_async_context(connect(ws_url(server.url), API_KEY))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(three.recv(), 30)
            return three.close_code, three.close_reason or ""

    code, reason = run(scenario())
    assert code == 1013 and "too many realtime sessions" in reason


def test_idle_session_closes_and_a_gone_client_frees_its_generation(
    server: ServeProcess,
) -> None:
    async def idle() -> tuple[int | None, list[str]]:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await client.recv(30)
            return ws.close_code, [e["error"]["code"] for e in client.of("error")]

    async def vanish() -> None:
        async with connect(ws_url(server.url), API_KEY) as ws:
            client = Client(ws)
            await client.until("session.created")
            item = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a very long story."}],
            }
            await client.send("session.update", session={**MANUAL, "max_output_tokens": 2000})
            await client.send("conversation.item.create", item=item)
            await client.send("response.create")
            await client.until("response.output_audio_transcript.delta")
        # closed mid-answer

    code, errors = run(idle())
    assert code == 1000 and errors == ["idle_timeout"]
    run(vanish())
    deadline = time.monotonic() + 20
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        while True:
            slots = http.get("/slots").json()
            if not any(s["is_processing"] or s["state"] == "queued" for s in slots):
                break
            assert time.monotonic() < deadline, "the generation of a gone client still runs"
            time.sleep(0.2)


def test_501_names_the_missing_models() -> None:
    with ServeProcess(["--audio-model", "default"]) as audio_only:

        async def refused() -> tuple[int, dict[str, Any]]:
            with pytest.raises(websockets.InvalidStatus) as info:
                async with websockets.connect(ws_url(audio_only.url)):
                    pass
            response = info.value.response
            return int(response.status_code), json.loads(response.body or b"{}")

        status, body = run(refused())
    assert status == 501
    assert body["error"]["type"] == "not_implemented"
    message = body["error"]["message"]
    assert "-m MODEL" in message and "--tts-model" in message and "--audio-model" not in message
    assert "(it serves transcription)" in message  # the spec: the message names what is served
