"""The engine-side pieces of `/v1/realtime`: G.711 codecs, turn detection on real speech
(Piper) with silence around it, and the sentence splitter that feeds streaming speech."""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.audio import SENTENCE, synthesize_speech, tiny_whisper_dir
from mlx_whisper.tokenizer import get_tokenizer

from mlxcel.engine.audio.codec import resample
from mlxcel.engine.audio.transcribe import transcribe
from mlxcel.engine.audio.whisper import load_whisper
from mlxcel.engine.voice.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from mlxcel.engine.voice.sentences import SentenceChunker
from mlxcel.engine.voice.vad import SpeechStarted, SpeechStopped, TurnDetector, aggressiveness


@pytest.mark.parametrize(
    ("encode", "decode"), [(ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)]
)
def test_g711_round_trips_within_its_step(encode, decode) -> None:  # type: ignore[no-untyped-def]
    pcm = (np.sin(np.linspace(0, 60, 8000)) * 30000).astype(np.int16)
    back = decode(encode(pcm)).astype(np.int32)
    error = np.abs(back - pcm)
    # G.711 keeps about 4 significant bits: each value within 1/16 of its size (+ the step
    # at zero).
    assert np.all(error <= np.abs(pcm.astype(np.int32)) / 16 + 16)
    codes = bytes(range(256))
    again = encode(decode(codes))
    # Every code decodes and encodes back to itself (µ-law's two zeros are one value).
    assert sum(a != b for a, b in zip(again, codes, strict=True)) <= 1


def test_g711_known_values() -> None:
    # ITU-T G.711 reference points: µ-law 0xFF and A-law 0xD5 are the smallest positive
    # steps, 0x80 / 0xAA the largest positive values.
    assert ulaw_decode(bytes([0xFF, 0x80, 0x00])).tolist() == [0, 32124, -32124]
    assert alaw_decode(bytes([0xD5, 0xAA, 0x2A])).tolist() == [8, 32256, -32256]


@pytest.fixture(scope="module")
def speech16k() -> np.ndarray:
    samples, rate = synthesize_speech(SENTENCE)
    return resample(samples.astype(np.float32) / 32768.0, rate, 16_000)


def _events(detector: TurnDetector, audio: np.ndarray, chunk: int = 1600) -> list[object]:
    out: list[object] = []
    for start in range(0, len(audio), chunk):
        out += detector.feed(audio[start : start + chunk])
    return out


def test_turn_detector_finds_speech_between_silences(speech16k: np.ndarray) -> None:
    silence = np.zeros(16_000, dtype=np.float32)
    audio = np.concatenate([silence, speech16k, silence])
    events = _events(TurnDetector(threshold=0.5, silence_ms=500), audio)
    assert len(events) == 2
    started, stopped = events
    assert isinstance(started, SpeechStarted) and isinstance(stopped, SpeechStopped)
    speech_ms = len(speech16k) * 1000 // 16_000
    assert 950 <= started.ms <= 1200  # speech starts at 1000 ms (Piper's own lead-in after)
    assert abs(stopped.ms - (1000 + speech_ms)) <= 150


def test_turn_detector_waits_for_the_silence(speech16k: np.ndarray) -> None:
    detector = TurnDetector(threshold=0.5, silence_ms=800)
    events = _events(detector, np.concatenate([speech16k, np.zeros(8000, np.float32)]))
    assert [type(e) for e in events] == [SpeechStarted]  # 500 ms of silence: still speaking
    assert detector.speaking
    assert [type(e) for e in detector.feed(np.zeros(8000, np.float32))] == [SpeechStopped]


def test_turn_detector_ignores_silence_and_quiet_noise() -> None:
    noise = np.random.default_rng(0).normal(0, 0.001, 48_000).astype(np.float32)
    assert _events(TurnDetector(), noise) == []
    assert aggressiveness(0.0) == 0 and aggressiveness(0.5) == 2 and aggressiveness(1.0) == 3


def test_sentences_come_out_as_soon_as_they_end() -> None:
    chunker = SentenceChunker()
    out: list[list[str]] = []
    for piece in ["Hello th", "ere, my friend. ", "Dr. Smith is", " here! Next", " one"]:
        out.append(chunker.feed(piece))
    assert out == [[], ["Hello there, my friend."], [], ["Dr. Smith is here!"], []]
    assert chunker.finish() == ["Next one"]
    assert chunker.finish() == []


def test_a_long_first_sentence_is_spoken_from_its_first_clause() -> None:
    chunker = SentenceChunker()
    out = [
        chunker.feed(piece)
        for piece in ["Paris, of course", ", is the capital of France, ", "and its largest city. "]
    ]
    # "Paris," is too short to say alone; the next clause ends the first piece; later commas
    # wait for the sentence's end.
    assert out == [[], ["Paris, of course, is the capital of France,"], ["and its largest city."]]
    again = SentenceChunker()
    assert again.feed("Yes, it is. The capital of France, as you asked, ") == ["Yes, it is."]
    assert again.finish() == ["The capital of France, as you asked,"]


def test_long_text_breaks_at_a_colon_and_lines_break_always() -> None:
    chunker = SentenceChunker(soft_chars=40)
    assert chunker.feed("Here is a fairly long list of things to say: apples, pears ") == [
        "Here is a fairly long list of things to say:"
    ]
    assert chunker.feed("and plums\nOk\n") == ["apples, pears and plums", "Ok"]


def test_loading_whisper_builds_its_tokenizer_before_the_first_turn() -> None:
    get_tokenizer.cache_clear()
    model = load_whisper(str(tiny_whisper_dir()))
    assert get_tokenizer.cache_info().currsize == 1
    # The first transcription finds it built (a hit, no new entry).
    transcribe(model, np.zeros(16_000, dtype=np.float32))
    info = get_tokenizer.cache_info()
    assert info.currsize == 1 and info.hits >= 1
