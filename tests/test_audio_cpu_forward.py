"""The numpy Whisper forward (`cpu_whisper`) against mlx-whisper's, the numpy resampler
against scipy's, long recordings in windows with progress, and the lazy word-timing import.

The real-model tests read Piper recordings with the shipped Whisper tiny.en; the others use a
tiny random checkpoint, where the two forwards must agree number for number.
"""

from __future__ import annotations

import os
import subprocess
import sys
from math import gcd
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.audio import (
    SENTENCE,
    long_speech_wav,
    speech_wav,
    tiny_whisper_dir,
    word_error_rate,
)

from mlxcel.config.process_env import WHISPER_AUDIO_CTX, WHISPER_FORWARD
from mlxcel.engine.audio import cpu_whisper
from mlxcel.engine.audio.codec import read_audio, resample
from mlxcel.engine.audio.transcribe import TranscriptionOptions, transcribe
from mlxcel.engine.audio.whisper import WhisperModel, load_whisper
from mlxcel.engine.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlx_tiny() -> WhisperModel:
    return load_whisper(str(tiny_whisper_dir()), forward="mlx")


@pytest.fixture(scope="module")
def numpy_tiny() -> WhisperModel:
    """The whole 30-second window, as mlx-whisper encodes it: a random model's tokens depend
    on every encoder row (the shipped tiny.en's do not, see test_audio_ctx_choice)."""
    return load_whisper(str(tiny_whisper_dir()), forward="numpy", audio_ctx="full")


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return read_audio(speech_wav().read_bytes()).samples


def test_gelu_is_the_exact_erf_one() -> None:
    from scipy.special import erf

    x = np.linspace(-12, 12, 200_001, dtype=np.float32)
    expected = x.astype(np.float64) * 0.5 * (1 + erf(x.astype(np.float64) / np.sqrt(2)))
    got = cpu_whisper.gelu_(x.copy())
    assert got.dtype == np.float32
    assert np.abs(got - expected).max() < 2e-6
    assert abs(got[0]) < 1e-20 and got[-1] == pytest.approx(12.0)


def test_encoder_matches_mlx_whisper(mlx_tiny: WhisperModel) -> None:
    model = mlx_tiny.model
    encoder = cpu_whisper.AudioEncoder(model.encoder, model.dims.n_audio_head)
    mel = mx.array(np.random.default_rng(0).standard_normal((2, 3000, 80)).astype(np.float32))
    expected = np.array(model.encoder(mel))
    got = np.array(encoder(mel))
    assert got.shape == expected.shape == (2, 1500, model.dims.n_audio_state)
    assert np.abs(got - expected).max() < 1e-4
    with pytest.raises(ValueError, match="audio shape"):
        encoder(mel[:, :2001])  # an odd number of frames
    with pytest.raises(ValueError, match="audio shape"):
        encoder(mx.concatenate([mel, mel], axis=1))  # longer than a window


def test_audio_frames_leaves_out_the_padding() -> None:
    mel = np.zeros((3000, 80), np.float32)
    assert cpu_whisper.audio_frames(mel) == 256  # nothing: the margin, rounded up
    mel[:277] = 0.5  # a 2.77 s clip, then mlx-whisper's zero frames
    assert cpu_whisper.audio_frames(mel) == 512  # 277 + 200, rounded up to 128
    mel[2900] = 0.1
    assert cpu_whisper.audio_frames(mel) == 3000  # never more than the window


def test_auto_audio_ctx_encodes_fewer_frames(mlx_tiny: WhisperModel) -> None:
    """A padded window: `auto` encodes its audio and the margin, and those rows are close to
    what the whole window gives (attention sees the padding only through the rest)."""
    model = mlx_tiny.model
    auto = cpu_whisper.AudioEncoder(model.encoder, model.dims.n_audio_head)
    full = cpu_whisper.AudioEncoder(model.encoder, model.dims.n_audio_head, audio_ctx="full")
    mel = np.zeros((1, 3000, 80), np.float32)
    mel[0, :300] = np.random.default_rng(2).standard_normal((300, 80))
    short, whole = np.array(auto(mx.array(mel))), np.array(full(mx.array(mel)))
    assert short.shape == (1, 256, model.dims.n_audio_state)  # 512 mel frames
    assert whole.shape == (1, 1500, model.dims.n_audio_state)
    with pytest.raises(ValueError, match="audio_ctx must be one of"):
        cpu_whisper.AudioEncoder(model.encoder, model.dims.n_audio_head, audio_ctx="half")


def test_decoder_matches_mlx_whisper_with_and_without_cache(mlx_tiny: WhisperModel) -> None:
    model = mlx_tiny.model
    decoder = cpu_whisper.TextDecoder(model.decoder, model.dims.n_text_head)
    rng = np.random.default_rng(1)
    features = mx.array(rng.standard_normal((1, 1500, model.dims.n_audio_state)), mx.float32)
    prompt = mx.array([[50257, 50362, 383, 2068, 7586]])
    expected, _, expected_qk = model.decoder(prompt, features)
    got, _, got_qk = decoder(prompt, features)
    assert np.abs(np.array(got) - np.array(expected)).max() < 1e-4
    for ours, theirs in zip(got_qk, expected_qk, strict=True):
        assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-4
    # the same logits one token at a time through the cache (causal masking is right)
    cache = None
    for position in range(prompt.shape[1]):
        step, cache, _ = decoder(prompt[:, position : position + 1], features, kv_cache=cache)
        last = np.array(step)[0, -1]
        assert np.abs(last - np.array(expected)[0, position]).max() < 1e-4
    assert cache is not None and cache.length == prompt.shape[1]
    doubled = cache[[0, 0]]  # beam search reorders / repeats the batch
    assert doubled.length == cache.length
    assert all(kv is not None and kv[0].shape[0] == 2 for kv in doubled.self_kv)


def test_numpy_forward_transcribes_like_mlx(
    mlx_tiny: WhisperModel, numpy_tiny: WhisperModel, speech: np.ndarray
) -> None:
    assert numpy_tiny.forward == "numpy" and mlx_tiny.forward == "mlx"
    ours, theirs = transcribe(numpy_tiny, speech), transcribe(mlx_tiny, speech)
    assert [s.tokens for s in ours.segments] == [s.tokens for s in theirs.segments]
    assert ours.text == theirs.text


def test_forward_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="forward must be one of"):
        load_whisper(str(tiny_whisper_dir()), forward="torch")
    monkeypatch.setenv(WHISPER_FORWARD, "mlx")
    assert load_whisper(str(tiny_whisper_dir())).forward == "mlx"
    monkeypatch.setenv(WHISPER_FORWARD, "auto")
    assert load_whisper(str(tiny_whisper_dir())).forward == "numpy"  # tests run on the CPU


@pytest.mark.parametrize("source", [22_050, 44_100, 48_000, 8_000, 11_025, 24_000, 32_000, 16_001])
def test_resampling_matches_scipy(source: int) -> None:
    from scipy.signal import resample_poly

    rng = np.random.default_rng(source)
    samples = rng.standard_normal(source + 123).astype(np.float32)
    common = gcd(source, 16_000)
    expected = resample_poly(samples, 16_000 // common, source // common)
    got = resample(samples, source, 16_000)
    assert got.dtype == np.float32 and len(got) == len(expected)
    assert np.abs(got - expected).max() < 1e-5


def test_resampling_keeps_a_tone() -> None:
    t = np.arange(22_050) / 22_050
    tone = np.sin(2 * np.pi * 440 * t).astype(np.float32)
    out = resample(tone, 22_050, 16_000)
    expected = np.sin(2 * np.pi * 440 * np.arange(16_000) / 16_000)
    assert np.abs(out[200:-200] - expected[200:-200]).max() < 1e-3


def test_word_timing_module_loads_only_when_word_timestamps_are_asked() -> None:
    script = f"""
import sys
import numpy as np
from mlxcel.engine.audio.transcribe import TranscriptionOptions, transcribe
from mlxcel.engine.audio.whisper import load_whisper
model = load_whisper({str(tiny_whisper_dir())!r})
audio = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
transcribe(model, audio)
print("before", "numba" in sys.modules, "scipy.signal" in sys.modules)
words = transcribe(model, audio, TranscriptionOptions(word_timestamps=True)).words
print("after", "numba" in sys.modules, bool(words))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "before False False" in done.stdout, done.stdout
    assert "after True True" in done.stdout, done.stdout


# ----------------------------------------------------------------- the shipped tiny.en


@pytest.fixture(scope="module")
def tiny_en() -> WhisperModel:
    return load_whisper(None)


@pytest.mark.slow
def test_shipped_tiny_en_agrees_across_forwards(tiny_en: WhisperModel, speech: np.ndarray) -> None:
    assert tiny_en.forward == "numpy"
    ours = transcribe(tiny_en, speech)
    theirs = transcribe(load_whisper(None, forward="mlx"), speech)
    assert word_error_rate(SENTENCE, ours.text) == 0.0, ours.text
    assert [s.tokens for s in ours.segments] == [s.tokens for s in theirs.segments]
    timed = transcribe(tiny_en, speech, TranscriptionOptions(word_timestamps=True))
    assert [w.word.strip(".") for w in timed.words] == SENTENCE.rstrip(".").split()
    assert all(a.start <= b.start for a, b in zip(timed.words, timed.words[1:], strict=False))


@pytest.mark.slow
def test_a_long_recording_is_read_in_windows_with_progress(tiny_en: WhisperModel) -> None:
    path, text = long_speech_wav()
    audio = read_audio(path.read_bytes())
    assert audio.duration > 60
    seen: list[tuple[float, float]] = []
    result = transcribe(tiny_en, audio.samples, progress=lambda d, t: seen.append((d, t)))
    assert word_error_rate(text, result.text) <= 0.05, result.text
    total = len(audio.samples) / 16_000
    assert len(seen) >= 3  # at least one call per 30-second window
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1] == (total, total)
    assert result.segments[-1].end > 60 and result.segments[-1].seek > 0
    assert all(
        a.start <= b.start for a, b in zip(result.segments, result.segments[1:], strict=False)
    )


@pytest.mark.slow
def test_audio_ctx_choice(
    tiny_en: WhisperModel, monkeypatch: pytest.MonkeyPatch, speech: np.ndarray
) -> None:
    """`MLXCEL_WHISPER_AUDIO_CTX` picks the encoder's length; a bad value is a load error;
    the shipped tiny.en gives the same words either way on real speech."""
    monkeypatch.setenv(WHISPER_AUDIO_CTX, "half")
    with pytest.raises(ModelLoadError, match="audio context"):
        load_whisper(None)
    monkeypatch.setenv(WHISPER_AUDIO_CTX, "full")
    full = load_whisper(None)
    assert full.model.encoder.audio_ctx == "full" and tiny_en.model.encoder.audio_ctx == "auto"
    ours, whole = transcribe(tiny_en, speech), transcribe(full, speech)
    assert word_error_rate(SENTENCE, ours.text) == 0.0, ours.text
    assert [s.tokens for s in ours.segments] == [s.tokens for s in whole.segments]


@pytest.mark.slow
def test_a_prompt_on_a_short_window_does_not_loop(
    tiny_en: WhisperModel, speech: np.ndarray
) -> None:
    """With a prompt ('Fox', or the previous window's text) the shortened encoder input made
    tiny.en repeat the sentence until its token budget ran out, at every fallback
    temperature (about 20 times, compression ratio 7); such a window is decoded again on
    the whole 30 s, as mlx-whisper decodes it."""
    assert tiny_en.model.encoder.audio_ctx == "auto"
    for prompt in ("Fox", "The quick brown fox"):
        result = transcribe(tiny_en, speech, TranscriptionOptions(prompt=prompt))
        assert word_error_rate(SENTENCE, result.text) == 0.0, (prompt, result.text)
        assert result.segments[0].temperature == 0.0
    assert tiny_en.model.encoder.audio_ctx == "auto"  # the retry leaves it as it was
