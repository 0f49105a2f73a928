"""The audio engine: decoding, CTranslate2 conversion, transcription, formats, Kokoro, worker."""

from __future__ import annotations

import io
import json
import os
import stat
import struct
import sys
import threading
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.audio import (
    KOKORO_SYMBOLS,
    TINY_WHISPER_DIMS,
    build_tiny_whisper,
    mlx_whisper_weights,
    speech_wav,
    tiny_kokoro_dir,
    tiny_whisper_dir,
    until_stopped,
    write_ct2_whisper,
    write_pcm16_wav,
)

from mlxcel.engine.audio import codec, ct2, formats, phonemize
from mlxcel.engine.audio.codec import AudioDecodeError, read_audio, resample, write_wav
from mlxcel.engine.audio.dtw import dtw
from mlxcel.engine.audio.transcribe import (
    Segment,
    Transcription,
    TranscriptionCancelled,
    TranscriptionOptions,
    Word,
    language_code,
    transcribe,
)
from mlxcel.engine.audio.tts import (
    KokoroModel,
    load_kokoro,
    resolve_voice,
    split_phonemes,
    synthesize,
)
from mlxcel.engine.audio.whisper import (
    STORE_VARIANT,
    WhisperModel,
    is_mlx_whisper_dir,
    load_whisper,
    resolve_whisper,
)
from mlxcel.engine.errors import InvalidRequestError, ModelLoadError, QueueFullError
from mlxcel.engine.workers.audio import AudioModels, AudioUnavailableError, AudioWorker
from mlxcel.engine.workers.errors import WorkerStoppedError, WorkerTimeoutError


def wav_bytes(samples: np.ndarray, rate: int, *, tag: int, bits: int, channels: int = 1) -> bytes:
    """A WAV file with any format tag / sample size, built by hand."""
    frames = samples.tobytes()
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the real tag sits in the sub-format GUID
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", 1) + b"\x00" * 14
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"LIST" + struct.pack("<I", 4) + b"INFO"  # an extra chunk to skip
    body += b"data" + struct.pack("<I", len(frames)) + frames
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.fixture(scope="module")
def tiny_whisper() -> WhisperModel:
    return load_whisper(str(tiny_whisper_dir()))


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return read_audio(speech_wav().read_bytes()).samples


@pytest.fixture(scope="module")
def kokoro() -> KokoroModel:
    return load_kokoro(str(tiny_kokoro_dir()))


# --------------------------------------------------------------------------- decoding


def test_wav_pcm16_is_read_and_resampled_to_16k(tmp_path: Path) -> None:
    tone = (np.sin(np.arange(22_050) * 2 * np.pi * 440 / 22_050) * 16_000).astype(np.int16)
    path = write_pcm16_wav(tmp_path / "tone.wav", tone, 22_050)
    audio = read_audio(path.read_bytes())
    assert audio.sample_rate == 16_000
    assert audio.samples.dtype == np.float32
    assert len(audio.samples) == 16_000 and audio.duration == pytest.approx(1.0)
    assert np.abs(audio.samples).max() == pytest.approx(16_000 / 32_768, rel=0.02)


@pytest.mark.parametrize(
    ("tag", "bits", "encode"),
    [
        (1, 8, lambda x: np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8)),
        (1, 16, lambda x: (x * 32767).astype("<i2")),
        (1, 32, lambda x: (x * 2**31 * 0.999).astype("<i4")),
        (3, 32, lambda x: x.astype("<f4")),
        (3, 64, lambda x: x.astype("<f8")),
        (0xFFFE, 16, lambda x: (x * 32767).astype("<i2")),
    ],
)
def test_wav_encodings(tag: int, bits: int, encode: Callable[[np.ndarray], np.ndarray]) -> None:
    signal = np.linspace(-0.5, 0.5, 1600, dtype=np.float64)
    audio = read_audio(wav_bytes(encode(signal), 16_000, tag=tag, bits=bits))
    assert np.allclose(audio.samples, signal, atol=0.01)


def test_wav_24_bit_and_stereo_downmix() -> None:
    left = np.full(800, 0.5)
    right = np.full(800, -0.25)
    ints = (np.stack([left, right], axis=1).reshape(-1) * (2**23 - 1)).astype(np.int32)
    raw = np.stack([ints & 0xFF, (ints >> 8) & 0xFF, (ints >> 16) & 0xFF], axis=1)
    data = wav_bytes(raw.astype(np.uint8), 16_000, tag=1, bits=24, channels=2)
    audio = read_audio(data)
    assert len(audio.samples) == 800
    assert np.allclose(audio.samples, 0.125, atol=1e-4)


def test_flac_through_soundfile() -> None:
    import soundfile

    signal = (np.sin(np.arange(8000) / 10) * 0.3).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, signal, 8000, format="FLAC")
    audio = read_audio(buffer.getvalue())
    assert codec.sniff_format(buffer.getvalue()) == "flac"
    assert len(audio.samples) == 16_000
    assert np.allclose(audio.samples[::2][100:-100], signal[100:-100], atol=0.02)


def test_other_formats_need_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "find_ffmpeg", lambda: None)
    with pytest.raises(AudioDecodeError) as info:
        read_audio(b"ID3\x04" + b"\x00" * 64, name="song.mp3")
    message = str(info.value)
    assert "song.mp3" in message and "mp3" in message and "ffmpeg is not installed" in message
    assert "\n" not in message


def test_ffmpeg_is_asked_for_16k_mono_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "ffmpeg"
    log = tmp_path / "args.json"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, struct, sys\n"
        f"json.dump(sys.argv[1:], open({str(log)!r}, 'w'))\n"
        "sys.stdin.buffer.read()\n"
        "sys.stdout.buffer.write(struct.pack('<4f', 0.0, 0.25, -0.25, 0.5))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    audio = read_audio(b"OggS" + b"\x00" * 60, name="clip.ogg")
    assert audio.samples.tolist() == [0.0, 0.25, -0.25, 0.5]
    args = json.loads(log.read_text())
    assert args[args.index("-ar") + 1] == "16000" and args[args.index("-ac") + 1] == "1"
    assert args[-1] == "pipe:1" and args[args.index("-f", args.index("-i")) + 1] == "f32le"
    # only the pipe, only the ogg demuxer: a playlist over the pipe cannot name other files
    before_input = args[: args.index("-i")]
    assert before_input[before_input.index("-f") + 1] == "ogg"
    assert before_input[before_input.index("-protocol_whitelist") + 1] == "pipe"
    assert before_input[before_input.index("-format_whitelist") + 1] == "ogg"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "empty"),
        (b"RIFF\x10\x00\x00\x00WAVEjunk\x00\x00\x00\x00", "malformed WAV"),
        (wav_bytes(np.zeros(0, dtype="<i2"), 16_000, tag=1, bits=16), "no audio samples"),
        (wav_bytes(np.zeros(4, dtype="<i2"), 16_000, tag=2, bits=16), "unsupported WAV encoding"),
    ],
)
def test_bad_audio_is_one_line(data: bytes, needle: str) -> None:
    with pytest.raises(AudioDecodeError) as info:
        read_audio(data, name="x.wav")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_write_wav_is_pcm16_mono_and_clips() -> None:
    data = write_wav(np.array([0.0, 0.5, -2.0, np.nan, 1.5], dtype=np.float32), 24_000)
    with wave.open(io.BytesIO(data)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 24_000)
        values = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2").tolist()
    assert values == [0, 16384, -32767, 0, 32767]


def test_resample_lengths() -> None:
    assert len(resample(np.zeros(44_100, dtype=np.float32), 44_100, 16_000)) == 16_000
    assert len(resample(np.zeros(8_000, dtype=np.float32), 8_000, 16_000)) == 16_000


# --------------------------------------------------------------------------- CTranslate2


def test_ct2_conversion_round_trips_every_tensor(tmp_path: Path) -> None:
    source = tiny_whisper_dir()
    weights = mlx_whisper_weights(source)
    heads = [[1, 0], [1, 1]]
    quantized = "decoder/layer_0/ffn/linear_0"
    ct2_dir = write_ct2_whisper(
        weights, TINY_WHISPER_DIMS, tmp_path / "ct2", alignment_heads=heads, int8=(quantized,)
    )
    dims = ct2.convert_whisper(ct2_dir, tmp_path / "mlx")
    assert dims == TINY_WHISPER_DIMS
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert config["model_type"] == "whisper" and config["n_text_layer"] == 2
    converted = mlx_whisper_weights(tmp_path / "mlx")
    assert converted.pop("alignment_heads").tolist() == heads
    assert set(converted) == set(weights) - {"alignment_heads"}
    for name, value in converted.items():
        tolerance = 0.02 if name.startswith("decoder.blocks.0.mlp1.") else 2e-3
        assert value.shape == weights[name].shape, name
        assert np.allclose(value, weights[name], atol=tolerance), name


def test_ct2_reader_rejects_other_models(tmp_path: Path) -> None:
    bad = tmp_path / "model.bin"
    bad.write_bytes(struct.pack("<I", 6) + struct.pack("<H", 12) + b"BertSpecXXX\0")
    with pytest.raises(ModelLoadError, match="truncated"):
        ct2.read_model_bin(bad)
    old = tmp_path / "old.bin"
    old.write_bytes(struct.pack("<I", 2))
    with pytest.raises(ModelLoadError, match="too old"):
        ct2.read_model_bin(old)


def test_ct2_model_is_converted_once_into_the_store(tmp_path: Path) -> None:
    ct2_dir = write_ct2_whisper(
        mlx_whisper_weights(tiny_whisper_dir()), TINY_WHISPER_DIMS, tmp_path / "faster-whisper"
    )
    store = tmp_path / "store"
    first, _, source = resolve_whisper(str(ct2_dir), store_dir=str(store))
    assert source == "ctranslate2" and first.parent == store
    assert first.name.endswith(STORE_VARIANT)
    stamp = (first / "weights.safetensors").stat().st_mtime_ns
    again, _, _ = resolve_whisper(str(ct2_dir), store_dir=str(store))
    assert again == first and (again / "weights.safetensors").stat().st_mtime_ns == stamp
    manifest = json.loads((first / "mlxcel.json").read_text())
    assert manifest["kind"] == "whisper" and manifest["format"] == "ctranslate2"


def test_ct2_model_without_a_usable_store_converts_for_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that cannot be written (read-only home, a file in its place) made every
    `transcribe` on a CTranslate2 model fail ('cannot convert ...'), the shipped tiny.en
    too, where a GGUF warns and loads; Whisper now does the same."""
    ct2_dir = write_ct2_whisper(
        mlx_whisper_weights(tiny_whisper_dir()), TINY_WHISPER_DIMS, tmp_path / "faster-whisper"
    )
    not_a_dir = tmp_path / "store"
    not_a_dir.write_text("a file where the store should be")
    with caplog.at_level("WARNING"):
        path, _, source = resolve_whisper(str(ct2_dir), store_dir=str(not_a_dir))
    assert source == "ctranslate2" and is_mlx_whisper_dir(path)
    assert not path.is_relative_to(tmp_path)
    assert "could not save" in caplog.text and str(ct2_dir) in caplog.text
    assert load_whisper(str(ct2_dir), store_dir=str(not_a_dir)).source == "ctranslate2"


def test_shipped_tiny_en_converts_to_mlx_whisper_names(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_whisper.whisper import ModelDimensions, Whisper

    path, name, source = resolve_whisper(None, store_dir=str(tmp_path))
    assert (name, source) == ("whisper-tiny.en", "default")
    config = json.loads((path / "config.json").read_text())
    assert config["n_vocab"] == 51864 and config["n_text_layer"] == 4 and config["n_mels"] == 80
    loaded = mx.load(str(path / "weights.safetensors"))
    assert isinstance(loaded, dict)
    config.pop("model_type")
    expected = dict(tree_flatten(Whisper(ModelDimensions(**config), mx.float32).parameters()))
    assert set(loaded) == set(expected)
    for key, value in loaded.items():
        if key != "alignment_heads":
            assert value.shape == expected[key].shape, key
    assert loaded["alignment_heads"].shape == (8, 2)


def test_unknown_whisper_references(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a Whisper model directory"):
        resolve_whisper(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not a Hugging Face repo id"):
        resolve_whisper("no/such/thing/here")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        resolve_whisper("mlx-community/whisper-never-cached")


# --------------------------------------------------------------------------- transcription


def _reference_dtw(x: np.ndarray) -> np.ndarray:
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    trace = -np.ones((n + 1, m + 1))
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        i, j = (
            (i - 1, j - 1) if trace[i, j] == 0 else (i - 1, j) if trace[i, j] == 1 else (i, j - 1)
        )
    return np.array(path[::-1]).T


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (9, 40), (12, 12)])
def test_dtw_matches_the_sequential_recurrence(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(shape))
    for x in (rng.standard_normal(shape), np.round(rng.standard_normal(shape))):  # with ties
        assert np.array_equal(dtw(x.astype(np.float32)), _reference_dtw(x.astype(np.float32)))


def test_transcription_is_deterministic_and_reports_progress(
    tiny_whisper: WhisperModel, speech: np.ndarray
) -> None:
    seen: list[tuple[float, float]] = []
    first = transcribe(tiny_whisper, speech, progress=lambda d, t: seen.append((d, t)))
    second = transcribe(tiny_whisper, speech)
    assert first == second
    assert first.language == "en" and first.task == "transcribe"
    assert first.duration == pytest.approx(len(speech) / 16_000, abs=1e-3)
    seconds = len(speech) / 16_000
    assert seen and seen[-1] == (seconds, seconds)
    assert all(done <= total == seconds for done, total in seen)
    for segment in first.segments:
        assert 0.0 <= segment.start <= segment.end <= first.duration
        assert all(np.isfinite([segment.avg_logprob, segment.no_speech_prob]))


def test_word_timestamps_stay_inside_the_audio(
    tiny_whisper: WhisperModel, speech: np.ndarray
) -> None:
    result = transcribe(tiny_whisper, speech, TranscriptionOptions(word_timestamps=True))
    assert result.words, "word timestamps asked for, none returned"
    for word in result.words:
        assert 0.0 <= word.start <= word.end <= result.duration
    body = formats.as_verbose_json(result)
    assert body["words"] == [{"word": w.word, "start": w.start, "end": w.end} for w in result.words]


def test_transcription_can_be_stopped(tiny_whisper: WhisperModel) -> None:
    long_audio = np.zeros(16_000 * 45, dtype=np.float32)  # two windows
    windows: list[float] = []
    with pytest.raises(TranscriptionCancelled):
        transcribe(
            tiny_whisper,
            long_audio,
            TranscriptionOptions(temperature=0.5),
            progress=lambda done, _t: windows.append(done),
            should_stop=lambda: bool(windows),
        )
    assert len(windows) == 1


def test_language_checks(tiny_whisper: WhisperModel, speech: np.ndarray) -> None:
    assert language_code("English") == "en" and language_code(" de ") == "de"
    assert language_code(None) is None
    with pytest.raises(InvalidRequestError, match="unknown language"):
        language_code("klingon")
    with pytest.raises(InvalidRequestError, match="English-only"):
        transcribe(tiny_whisper, speech, TranscriptionOptions(language="fr"))
    with pytest.raises(InvalidRequestError, match="task"):
        transcribe(tiny_whisper, speech, TranscriptionOptions(task="summarize"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- formats


def _sample() -> Transcription:
    words = [Word("Hello", 0.0, 0.5, 0.9), Word("world.", 0.5, 1.25, 0.8)]
    return Transcription(
        text="Hello world. Bye.",
        language="en",
        duration=3661.5,
        task="transcribe",
        segments=[
            Segment(0, 0, 0.0, 1.25, " Hello world.", [1, 2], 0.0, -0.2, 1.1, 0.01, words),
            Segment(1, 0, 1.25, 1.25, " ", [], 0.0, -0.2, 1.1, 0.01),
            Segment(2, 0, 3600.0, 3661.5, " Bye.", [3], 0.2, -0.4, 1.0, 0.02),
        ],
    )


def test_srt_vtt_and_text() -> None:
    t = _sample()
    assert formats.timestamp(3661.5, ",") == "01:01:01,500"
    assert formats.render(t, "text") == "Hello world. Bye.\n"
    assert formats.as_srt(t) == (
        "1\n00:00:00,000 --> 00:00:01,250\nHello world.\n\n2\n01:00:00,000 --> 01:01:01,500\nBye.\n"
    )
    assert formats.as_vtt(t) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.250\nHello world.\n\n"
        "01:00:00.000 --> 01:01:01.500\nBye.\n"
    )
    per_word = formats.as_vtt(t, words=True)
    assert "00:00:00.000 --> 00:00:00.500\nHello\n" in per_word and "Bye" not in per_word


def test_json_bodies() -> None:
    t = _sample()
    assert json.loads(formats.render(t, "json")) == {"text": "Hello world. Bye."}
    verbose = formats.as_verbose_json(t)
    assert verbose["language"] == "english" and verbose["duration"] == 3661.5
    assert [s["id"] for s in verbose["segments"]] == [0, 1, 2]
    assert set(verbose["segments"][0]) == {
        "id", "seek", "start", "end", "text", "tokens", "temperature",
        "avg_logprob", "compression_ratio", "no_speech_prob",
    }  # fmt: skip
    assert verbose["words"][1] == {"word": "world.", "start": 0.5, "end": 1.25}
    only_words = formats.as_verbose_json(t, segments=False, words=True)
    assert "segments" not in only_words and len(only_words["words"]) == 2
    with pytest.raises(InvalidRequestError, match="json, text, srt, verbose_json, vtt"):
        formats.check_format("mp3")


# --------------------------------------------------------------------------- text to speech


def test_phonemes_from_espeak_are_rewritten_for_kokoro() -> None:
    assert phonemize.espeak_to_kokoro("həlˈoʊ wˈɜːld, dʒˈʌmps") == "həlˈO wˈɜɹld, ʤˈʌmps"
    assert phonemize.espeak_to_kokoro("ɡˈəʊ hˈəʊm", british=True) == "ɡˈQ hˈQm"
    assert phonemize.explicit_phonemes(" [[hˈI]] ") == "hˈI"
    assert phonemize.explicit_phonemes("hi [[x]]") is None


def test_bundled_espeak_phonemizer_is_offline_and_deterministic() -> None:
    assert "piper" in phonemize.available_phonemizers()
    first = phonemize._piper("Hello world, how are you?", False)
    assert first == phonemize._piper("Hello world, how are you?", False)
    assert first.startswith("həlˈO wˈɜɹld,") and first.endswith("?")
    assert "ː" not in first  # American English: no length marks
    assert set(first) <= set(KOKORO_SYMBOLS)


def test_no_phonemizer_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(phonemize, "available_phonemizers", lambda: [])
    with pytest.raises(phonemize.PhonemizerUnavailable, match=r"\[\[\.\.\.\]\]"):
        phonemize.phonemize("hello")


def test_split_phonemes_respects_the_limit() -> None:
    text = "ðə kwˈɪk bɹˈWn fˈɑks. ʤˈʌmps ˌOvəɹ ðə lˈAzi dˈɑɡ! " * 3
    pieces = split_phonemes(text, 30)
    assert all(0 < len(p) <= 30 for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    assert split_phonemes("a" * 70, 30) == ["a" * 30, "a" * 30, "a" * 10]


def test_kokoro_speaks_phonemes_at_24khz(kokoro: KokoroModel) -> None:
    normal = synthesize(kokoro, "[[hˈI ðɛɹ]]")
    assert normal.sample_rate == 24_000 and normal.voice == "af_heart"
    assert normal.phonemes == "hˈI ðɛɹ"
    assert normal.samples.dtype == np.float32 and normal.samples.ndim == 1
    assert len(normal.samples) > 0 and np.isfinite(normal.samples).all()
    assert np.abs(normal.samples).max() <= 1.0 and np.abs(normal.samples).max() > 0
    fast = synthesize(kokoro, "hˈI ðɛɹ", phonemes=True, speed=2.0)
    assert 0 < len(fast.samples) < len(normal.samples)
    with wave.open(io.BytesIO(write_wav(normal.samples, normal.sample_rate))) as wav:
        assert wav.getframerate() == 24_000 and wav.getnframes() == len(normal.samples)


def test_kokoro_text_goes_through_the_offline_phonemizer(kokoro: KokoroModel) -> None:
    speech = synthesize(kokoro, "Hi.", voice="fable")
    assert speech.voice == "bm_fable" and speech.phonemes == "hˈI."
    assert len(speech.samples) > 0


def test_kokoro_voices_and_input_checks(kokoro: KokoroModel) -> None:
    assert sorted(kokoro.voices) == ["af_heart", "bm_fable"]
    assert resolve_voice(kokoro, None) == "af_heart"
    assert resolve_voice(kokoro, "FABLE") == "bm_fable"
    assert resolve_voice(kokoro, "onyx") == "af_heart"  # no am_onyx pack: the default
    with pytest.raises(InvalidRequestError, match="available: af_heart, bm_fable"):
        resolve_voice(kokoro, "zz_nobody")
    for text, kwargs, needle in [
        ("   ", {}, "empty"),
        ("[[hˈI]]", {"speed": 9.0}, "speed"),
        ("[[§§§]]", {}, "no phonemes"),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            synthesize(kokoro, text, **kwargs)


def test_kokoro_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no text-to-speech model"):
        load_kokoro(None)
    with pytest.raises(ModelLoadError, match="not a Kokoro model directory"):
        load_kokoro(str(tmp_path))


# --------------------------------------------------------------------------- the worker


def _blocking_worker(**kwargs: Any) -> tuple[AudioWorker, threading.Event]:
    release = threading.Event()
    worker = AudioWorker(loader=AudioModels, **kwargs).start()
    return worker, release


def test_worker_queue_is_bounded() -> None:
    worker, release = _blocking_worker(queue_depth=1, timeout=None)
    started = threading.Event()

    def block(_models: AudioModels, _stop: Callable[[], bool]) -> str:
        started.set()
        release.wait(10)
        return "done"

    try:
        running = worker.submit(block)
        assert started.wait(10)
        queued = worker.submit(lambda _m, _s: "second")
        with pytest.raises(QueueFullError, match="1 audio requests already waiting"):
            worker.submit(lambda _m, _s: "third")
        release.set()
        assert running.result(10) == "done" and queued.result(10) == "second"
        assert worker.stats.jobs == 2
    finally:
        release.set()
        worker.stop()


def test_worker_timeout_stops_the_job_and_fails_its_future() -> None:
    worker, _ = _blocking_worker(timeout=1.0)
    started, stopped = threading.Event(), threading.Event()
    try:
        future = worker.submit(until_stopped(started, stopped))
        # what the job returned after its deadline does not count: the future fails
        with pytest.raises(WorkerTimeoutError, match="timed out after 1 s"):
            future.result(30)
        assert started.is_set() and stopped.is_set(), "the running job was not told to stop"
        assert worker.stats.timeouts == 1 and worker.stats.jobs == 0
    finally:
        worker.stop()


def test_cancelling_the_future_stops_the_running_job() -> None:
    """What the server does when its client goes away: cancel the future."""
    worker, _ = _blocking_worker(timeout=None)
    started, stopped = threading.Event(), threading.Event()
    try:
        future = worker.submit(until_stopped(started, stopped))
        assert started.wait(10)
        assert not future.cancel()  # it runs: it cannot be dropped, so it is told to stop
        assert stopped.wait(10), "the running job was not told to stop"
        assert worker.submit(lambda _m, _s: "next").result(10) == "next"
    finally:
        worker.stop()


def test_worker_without_models_and_after_stop(speech: np.ndarray) -> None:
    worker, _ = _blocking_worker()
    assert worker.ready and not worker.has_stt and not worker.has_tts
    with pytest.raises(AudioUnavailableError, match="speech-to-text"):
        worker.transcribe(speech, TranscriptionOptions()).result(10)
    with pytest.raises(AudioUnavailableError, match="text-to-speech"):
        worker.speak("[[hˈI]]").result(10)
    worker.stop()
    with pytest.raises(WorkerStoppedError):
        worker.submit(lambda _m, _s: None)


def test_worker_load_error_is_raised_by_start(tmp_path: Path) -> None:
    worker = AudioWorker(stt_model=str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="missing"):
        worker.start()
    worker.stop()


def test_worker_transcribes_like_the_engine(tiny_whisper: WhisperModel, speech: np.ndarray) -> None:
    worker = AudioWorker(stt_model=str(tiny_whisper_dir())).start()
    try:
        assert worker.has_stt and worker.models.stt is not None
        result = worker.transcribe(speech, TranscriptionOptions()).result(300)
        assert result == transcribe(tiny_whisper, speech)
    finally:
        worker.stop()


def test_worker_reports_progress_per_window(tiny_whisper: WhisperModel) -> None:
    long_audio = np.zeros(16_000 * 65, dtype=np.float32)  # three windows
    seen: list[tuple[float, float, object]] = []
    worker = AudioWorker(loader=lambda: AudioModels(stt=tiny_whisper)).start()
    try:

        def progress(done: float, total: float) -> None:
            seen.append((done, total, worker.progress))

        future = worker.transcribe(long_audio, TranscriptionOptions(), progress=progress)
        result = future.result(600)
    finally:
        worker.stop()
    assert result.duration == 65.0
    assert len(seen) >= 3 and seen[-1][:2] == (65.0, 65.0)
    assert [done for done, _, _ in seen] == sorted(done for done, _, _ in seen)
    assert all(p is not None and p.done_s == d for d, _, p in seen)  # readable while it runs
    assert worker.progress is None  # nothing running now
    assert worker.stats.audio_seconds == 65.0 and worker.stats.transcribe_seconds > 0


def test_mlx_whisper_directory_loads_in_float32_on_cpu(tmp_path: Path) -> None:
    import mlx.core as mx

    path = str(build_tiny_whisper(tmp_path / "w", seed=3))
    model = load_whisper(path, forward="mlx")
    assert model.source == "mlx" and not model.fp16 and not model.multilingual
    assert model.forward == "mlx"
    assert model.model.decoder.token_embedding.weight.dtype == mx.float32
    assert load_whisper(path).forward == "numpy"  # the default on the CPU
