"""G.711 µ-law and A-law (ITU-T G.711) to and from 16-bit PCM, in numpy (audioop is gone
from Python 3.13). One byte a sample, 8 kHz in telephony."""

from __future__ import annotations

import numpy as np

_BIAS = 0x84
_CLIP = 32635


def _ulaw_table() -> np.ndarray:
    codes = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = (((mantissa << 3) + _BIAS) << exponent) - _BIAS
    return np.where(sign != 0, -magnitude, magnitude).astype(np.int16)


def _alaw_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int32) ^ 0x55
    sign = codes & 0x80
    exponent = (codes >> 4) & 0x07
    mantissa = codes & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.int16)


ULAW_TO_PCM = _ulaw_table()
ALAW_TO_PCM = _alaw_table()


def ulaw_decode(data: bytes) -> np.ndarray:
    """µ-law bytes → int16 samples."""
    return ULAW_TO_PCM[np.frombuffer(data, dtype=np.uint8)]


def alaw_decode(data: bytes) -> np.ndarray:
    """A-law bytes → int16 samples."""
    return ALAW_TO_PCM[np.frombuffer(data, dtype=np.uint8)]


def _segment(magnitude: np.ndarray, base: int) -> np.ndarray:
    """The G.711 exponent (0-7) of each magnitude, counting from the segment at `base`."""
    exponent = np.zeros(magnitude.shape, dtype=np.int32)
    for step in range(1, 8):
        exponent += magnitude >= (base << step)
    return exponent


def ulaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples → µ-law bytes."""
    pcm = samples.astype(np.int32)
    sign = np.where(pcm < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(pcm), _CLIP) + _BIAS
    exponent = _segment(magnitude, 0x80)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def alaw_encode(samples: np.ndarray) -> bytes:
    """int16 samples → A-law bytes."""
    pcm = samples.astype(np.int32)
    sign = np.where(pcm >= 0, 0x80, 0)
    magnitude = np.minimum(np.where(pcm >= 0, pcm, -pcm - 1), 32767) >> 3
    exponent = _segment(magnitude, 0x10)
    mantissa = np.where(exponent == 0, magnitude >> 1, magnitude >> exponent) & 0x0F
    return (((sign | (exponent << 4) | mantissa) ^ 0x55) & 0xFF).astype(np.uint8).tobytes()
