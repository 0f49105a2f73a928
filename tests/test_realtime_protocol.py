"""`/v1/realtime`'s server pieces without a server: `session.update` in GA and beta names
and its refusals, the input buffer's turns (two turns in a row, a turn that stops in the
chunk that completes it, the cap), the audio wire formats, and conversation items as chat
turns."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from realtime_client import b64, silence_pcm, speech_pcm

from mlxcel.engine.voice.vad import SpeechStopped
from mlxcel.server.realtime.audio_wire import (
    base64_chunks,
    decode_audio,
    duration_ms,
    encode_audio,
)
from mlxcel.server.realtime.conversation import chat_turns, parse_item
from mlxcel.server.realtime.input_buffer import InputAudioBuffer
from mlxcel.server.realtime.protocol import (
    ClientEventError,
    SessionConfig,
    TurnDetection,
    apply_session_update,
)


def test_ga_session_update() -> None:
    config = apply_session_update(
        SessionConfig(),
        {
            "type": "realtime",
            "instructions": "Be short.",
            "output_modalities": ["text"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcmu"},
                    "turn_detection": {"type": "server_vad", "silence_duration_ms": 700},
                },
                "output": {"format": {"type": "audio/pcma"}, "voice": "bm_fable", "speed": 1.5},
            },
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_output_tokens": 99,
        },
    )
    assert config.instructions == "Be short." and config.output_modalities == ("text",)
    assert (config.input_format, config.output_format) == ("g711_ulaw", "g711_alaw")
    assert config.turn_detection == TurnDetection(silence_duration_ms=700)
    assert (config.voice, config.speed, config.max_output_tokens) == ("bm_fable", 1.5, 99)
    assert config.tools == ({"type": "function", "name": "f", "parameters": {"type": "object"}},)
    assert config.tool_choice == {"type": "function", "name": "f"}
    wire = config.wire("sess_1", "m")
    assert wire["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert wire["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 700
    assert apply_session_update(config, {"max_output_tokens": "inf"}).max_output_tokens is None


def test_beta_session_update() -> None:
    config = apply_session_update(
        SessionConfig(),
        {
            "modalities": ["text", "audio"],
            "input_audio_format": "g711_alaw",
            "output_audio_format": "pcm16",
            "turn_detection": None,
            "voice": "alloy",
            "temperature": 0.7,
            "max_response_output_tokens": 50,
        },
    )
    assert config.output_modalities == ("audio",)
    assert (config.input_format, config.output_format) == ("g711_alaw", "pcm16")
    assert config.turn_detection is None
    assert (config.voice, config.temperature, config.max_output_tokens) == ("alloy", 0.7, 50)


@pytest.mark.parametrize(
    ("session", "param"),
    [
        ("x", "session"),
        ({"type": "transcription"}, "session.type"),
        ({"instructions": 5}, "session.instructions"),
        ({"output_modalities": ["video"]}, "session.output_modalities"),
        ({"audio": {"input": {"format": {"rate": 44100}}}}, "session.audio.input.format.rate"),
        ({"audio": {"input": {"format": "mp3"}}}, "session.audio.input.format"),
        ({"turn_detection": {"threshold": 2}}, "session.turn_detection.threshold"),
        ({"turn_detection": {"silence_duration_ms": -1}},
         "session.turn_detection.silence_duration_ms"),
        ({"audio": {"output": {"speed": 9}}}, "session.audio.output.speed"),
        ({"tools": [{"type": "web_search"}]}, "session.tools[0].type"),
        ({"tools": [{"type": "function", "name": ""}]}, "session.tools[0].name"),
        ({"tool_choice": "sometimes"}, "session.tool_choice"),
        ({"max_output_tokens": 0}, "session.max_output_tokens"),
        ({"audio": ["x"]}, "session.audio"),
    ],
)  # fmt: skip
def test_bad_session_fields_name_their_param(session: Any, param: str) -> None:
    with pytest.raises(ClientEventError) as info:
        apply_session_update(SessionConfig(), session)
    assert info.value.param == param


def _feed(buffer: InputAudioBuffer, pcm: bytes, chunk_ms: int = 100) -> list[tuple[object, int]]:
    step = 24_000 * chunk_ms // 1000 * 2
    out = []
    for start in range(0, len(pcm), step):
        for turn in buffer.append(b64(pcm[start : start + step])):
            out.append((turn, buffer.session_ms(turn)))
            if isinstance(turn, SpeechStopped):
                taken = buffer.take(out[-2][1] - 300, out[-1][1] + 200)
                out.append((taken, len(taken)))
    return out


def test_buffer_gives_whole_turns_one_after_another() -> None:
    buffer = InputAudioBuffer("pcm16", 60, TurnDetection())
    speech = speech_pcm()
    events = _feed(buffer, silence_pcm(0.6) + speech + silence_pcm(1.0) + speech + silence_pcm(1.0))
    kinds = [type(e).__name__ for e, _ in events]
    assert kinds == ["SpeechStarted", "SpeechStopped", "ndarray"] * 2
    second_start = events[3][1]
    assert second_start > events[1][1] + 500  # session time goes on
    speech_samples = len(speech) // 2
    for taken, length in (events[2], events[5]):
        assert isinstance(taken, np.ndarray)
        # The whole reading (Piper's own silence at its ends aside) with the padding.
        assert speech_samples * 0.85 < length < speech_samples + 24_000
        assert np.abs(taken).max() > 10_000


def test_buffer_keeps_little_while_nobody_speaks_and_has_a_cap() -> None:
    buffer = InputAudioBuffer("pcm16", 2.0, TurnDetection(prefix_padding_ms=300))
    for _ in range(30):  # 3 s of silence in 100 ms chunks: trimmed as it comes
        buffer.append(b64(silence_pcm(0.1)))
    assert buffer.ms <= 2 * (300 + 500) + 100
    manual = InputAudioBuffer("pcm16", 2.0, None)
    manual.append(b64(silence_pcm(1.5)))
    with pytest.raises(ClientEventError) as info:
        manual.append(b64(silence_pcm(0.6)))
    assert info.value.code == "input_audio_buffer_full"
    assert manual.ms == 1500  # the refused chunk is not kept
    manual.clear()
    assert manual.ms == 0


def test_audio_wire_formats() -> None:
    with pytest.raises(ClientEventError):
        decode_audio("%%%", "pcm16")
    with pytest.raises(ClientEventError):
        decode_audio(b64(b"\x00\x01\x02"), "pcm16")
    tone = np.sin(np.linspace(0, 2 * np.pi * 440, 24_000)).astype(np.float32) * 0.5
    for fmt, size in (("pcm16", 48_000), ("g711_ulaw", 8_000), ("g711_alaw", 8_000)):
        data = encode_audio(tone, 24_000, fmt)  # type: ignore[arg-type]
        assert len(data) == size and duration_ms(data, fmt) == 1000  # type: ignore[arg-type]
        back = decode_audio(b64(data), fmt)  # type: ignore[arg-type]
        assert 0.4 < np.abs(back).max() / 32768 < 0.6
        chunks = base64_chunks(data, fmt, 200)  # type: ignore[arg-type]
        assert len(chunks) == 5 and b64(data) != "".join(chunks[:1])


def test_items_become_chat_turns() -> None:
    user, audio = parse_item(
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather?"},
            {"type": "input_audio", "transcript": "in Paris"},
        ]}
    )  # fmt: skip
    assert audio == []
    call_a, _ = parse_item(
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"}
    )
    call_b, _ = parse_item({"type": "function_call", "call_id": "c2", "name": "w", "arguments": ""})
    output, _ = parse_item({"type": "function_call_output", "call_id": "c1", "output": "sunny"})
    spoken, pending = parse_item(
        {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]}
    )
    assert len(pending) == 1 and pending[0].item is spoken and pending[0].content_index == 0
    turns = chat_turns("Be brief.", [user, call_a, call_b, output])
    messages = [t.message for t in turns]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather? in Paris"}
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    for bad in (
        "x",
        {"type": "image"},
        {"type": "message", "role": "tool", "content": []},
        {"type": "message", "role": "user", "content": [{"type": "input_audio"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_image"}]},
        {"type": "function_call_output", "call_id": 3, "output": "x"},
    ):
        with pytest.raises(ClientEventError):
            parse_item(bad)
