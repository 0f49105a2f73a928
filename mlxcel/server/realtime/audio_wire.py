"""Audio as it travels in Realtime events: base64 PCM16 (24 kHz) or G.711 (8 kHz), to and
from the float samples of Whisper (16 kHz) and Kokoro (its own rate)."""

from __future__ import annotations

import base64
import binascii

import numpy as np

from mlxcel.engine.audio.codec import resample, to_pcm16
from mlxcel.engine.voice.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from mlxcel.server.realtime.protocol import BYTES_PER_SAMPLE, RATES, AudioFormat, ClientEventError

WHISPER_RATE = 16_000


def decode_audio(data: str, fmt: AudioFormat) -> np.ndarray:
    """Base64 audio in `fmt` → int16 samples at the format's rate (ClientEventError if bad)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ClientEventError("audio is not valid base64", param="audio") from None
    if fmt == "g711_ulaw":
        return ulaw_decode(raw)
    if fmt == "g711_alaw":
        return alaw_decode(raw)
    if len(raw) % 2:
        raise ClientEventError("pcm16 audio must have an even number of bytes", param="audio")
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def longer_than(data: str, fmt: AudioFormat, seconds: float) -> bool:
    """Whether base64 `data` in `fmt` holds more than `seconds` of audio (judged before it
    is decoded)."""
    return len(data) * 3 // 4 > seconds * RATES[fmt] * BYTES_PER_SAMPLE[fmt]


def to_whisper(samples: np.ndarray, fmt: AudioFormat) -> np.ndarray:
    """int16 samples at `fmt`'s rate → float32 at Whisper's 16 kHz."""
    return resample(samples.astype(np.float32) / 32768.0, RATES[fmt], WHISPER_RATE)


def encode_audio(samples: np.ndarray, rate: int, fmt: AudioFormat) -> bytes:
    """float samples at `rate` → the bytes of `fmt` (resampled to its rate)."""
    pcm = to_pcm16(resample(samples, rate, RATES[fmt]))
    if fmt == "pcm16":
        return pcm
    ints = np.frombuffer(pcm, dtype="<i2")
    return ulaw_encode(ints) if fmt == "g711_ulaw" else alaw_encode(ints)


def base64_chunks(data: bytes, fmt: AudioFormat, chunk_ms: int) -> list[str]:
    """`data` cut into pieces of `chunk_ms` (whole samples), each base64."""
    step = max(2, RATES[fmt] * chunk_ms // 1000 * (2 if fmt == "pcm16" else 1))
    return [base64.b64encode(data[i : i + step]).decode("ascii") for i in range(0, len(data), step)]


def duration_ms(data: bytes, fmt: AudioFormat) -> float:
    """Milliseconds of audio in `data`."""
    return len(data) / (2 if fmt == "pcm16" else 1) * 1000 / RATES[fmt]
