"""Decoding a WAV payload (`input_audio`) into 16 kHz mono float32 samples."""

from __future__ import annotations

import io
import wave
from typing import Any

from mlxcel.engine.media.errors import MediaError

TARGET_RATE = 16_000
_DTYPES = {1: "u1", 2: "<i2", 4: "<i4"}


def decode_wav(data: bytes, max_seconds: float = 600.0) -> Any:
    """Mono float32 samples at 16 kHz from a PCM WAV file's bytes."""
    import numpy as np

    try:
        with wave.open(io.BytesIO(data)) as reader:
            channels = reader.getnchannels()
            width = reader.getsampwidth()
            rate = reader.getframerate()
            frames = reader.getnframes()
            if width not in _DTYPES or channels < 1 or rate <= 0:
                raise MediaError("input_audio must be 8/16/32-bit PCM WAV")
            if frames / rate > max_seconds:
                raise MediaError(f"input_audio is longer than {max_seconds:g} s")
            raw = reader.readframes(frames)
    except MediaError:
        raise
    except (wave.Error, EOFError, ValueError):
        raise MediaError("input_audio is not a valid WAV file") from None
    samples = np.frombuffer(raw, dtype=_DTYPES[width]).astype(np.float32)
    if width == 1:
        samples = (samples - 128.0) / 128.0
    else:
        samples /= float(2 ** (8 * width - 1))
    if channels > 1:
        samples = samples[: len(samples) - len(samples) % channels]
        samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != TARGET_RATE and len(samples):
        n_out = max(1, round(len(samples) * TARGET_RATE / rate))
        positions = np.linspace(0, len(samples) - 1, n_out)
        samples = np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)
    return samples
