"""Audio bytes ↔ float32 samples: WAV natively, FLAC through soundfile, the rest through ffmpeg.

`read_audio` turns the bytes of an audio file into mono float32 samples at the rate a model
wants; `write_wav` turns samples into a 16-bit PCM WAV file. WAV is parsed here (PCM 8/16/24/32
bit, IEEE float, WAVE_FORMAT_EXTENSIBLE) so the common case needs nothing but numpy. ffmpeg
only gets bytes of an allowlisted audio container, with its demuxer forced and no protocol but
the pipe (`ffmpeg_input`): playlists and other formats that name files or URLs are refused.
"""

from __future__ import annotations

import io
import struct
import subprocess
from dataclasses import dataclass
from math import gcd
from typing import TYPE_CHECKING

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.ffmpeg_input import AUDIO_CONTAINERS, find_ffmpeg, input_args, sniff_container

if TYPE_CHECKING:
    import numpy as np

WHISPER_SAMPLE_RATE = 16_000
NATIVE_FORMATS = ("wav", "flac")

_PCM = 1
_FLOAT = 3
_EXTENSIBLE = 0xFFFE
_FFMPEG_TIMEOUT_S = 600


class AudioDecodeError(InvalidRequestError):
    """The bytes are not audio this machine can decode (maps to HTTP 400)."""


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples in [-1, 1] and their sample rate."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0


def sniff_format(data: bytes) -> str | None:
    """The audio container of `data` from its magic bytes (wav, flac, ogg, mp3, aac, aiff, mp4,
    webm), or None for anything else (a video-only container, a playlist, text)."""
    kind = sniff_container(data)
    return kind if kind in AUDIO_CONTAINERS else None


def read_audio(
    data: bytes, *, sample_rate: int = WHISPER_SAMPLE_RATE, name: str = "audio"
) -> DecodedAudio:
    """Decode `data` (a whole audio file) to mono float32 at `sample_rate`.

    WAV is read natively, FLAC through soundfile when it is installed, the other containers of
    `sniff_format` through ffmpeg when it is on PATH. Raises AudioDecodeError with a one-line
    message otherwise.
    """
    if not data:
        raise AudioDecodeError(f"{name}: empty audio file")
    kind = sniff_format(data)
    if kind is None:
        raise AudioDecodeError(
            f"{name}: unsupported audio container (send wav, flac, ogg, mp3, aac, aiff, m4a/mp4 "
            "or webm bytes)"
        )
    if kind == "wav":
        decoded = _read_wav(data, name)
    elif kind == "flac" and _soundfile_available():
        decoded = _read_soundfile(data, name)
    else:
        decoded = _read_ffmpeg(data, sample_rate, name, kind)
    if len(decoded.samples) == 0:
        raise AudioDecodeError(f"{name}: the file holds no audio samples")
    return DecodedAudio(resample(decoded.samples, decoded.sample_rate, sample_rate), sample_rate)


def write_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """A mono 16-bit PCM WAV file holding `samples` (floats in [-1, 1], clipped)."""
    return _wav_header(len(samples), sample_rate) + to_pcm16(samples)


def to_pcm16(samples: np.ndarray) -> bytes:
    """Little-endian signed 16-bit PCM of float samples (NaN → 0, clipped to [-1, 1])."""
    import numpy as np

    clean = np.nan_to_num(np.asarray(samples, dtype=np.float32), nan=0.0, posinf=1.0, neginf=-1.0)
    return (np.clip(clean, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """`samples` at `target_rate`: a zero-phase polyphase filter (Kaiser-windowed sinc, the
    design of scipy's `resample_poly`) in numpy, so reading audio never imports scipy.signal
    (about a second)."""
    import numpy as np

    samples = np.asarray(samples, dtype=np.float32)
    if source_rate == target_rate or len(samples) == 0:
        return samples
    common = gcd(source_rate, target_rate)
    return _polyphase(samples, target_rate // common, source_rate // common)


_RESAMPLE_BLOCK = 262_144  # output samples per block (1 MiB per temporary)


def _polyphase(samples: np.ndarray, up: int, down: int) -> np.ndarray:
    """Upsample by `up`, low-pass, downsample by `down`; ceil(n * up / down) samples out.

    Output m is sum_i x[i] h[half + m*down - i*up]. Outputs m, m + up, m + 2*up, ... use the
    same taps (one phase of the filter) against inputs `down` apart, so each of the `up`
    classes is one matrix-vector product over a strided view of the input.
    """
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    rate = max(up, down)
    half = 10 * rate
    n_taps = 2 * half + 1
    offsets = np.arange(n_taps, dtype=np.float64) - half
    cutoff = 1.0 / rate
    taps = cutoff * np.sinc(cutoff * offsets) * np.kaiser(n_taps, 5.0)
    taps *= up / taps.sum()
    per_phase = -(-n_taps // up)
    phases = np.zeros(per_phase * up)
    phases[:n_taps] = taps
    # [phase, k]: the taps of a phase, oldest input first
    by_phase = phases.reshape(per_phase, up).T[:, ::-1].astype(np.float32)
    n_in = len(samples)
    n_out = -(-n_in * up // down)
    padded = np.concatenate(
        [np.zeros(per_phase, np.float32), samples, np.zeros(per_phase + half // up + 2, np.float32)]
    )
    out = np.empty(n_out, dtype=np.float32)
    item = padded.strides[0]
    for first in range(min(up, n_out)):
        count = len(range(first, n_out, up))
        t = first * down + half
        oldest = t // up + 1  # padded index of the oldest input this output meets
        window = as_strided(
            padded[oldest:], shape=(count, per_phase), strides=(down * item, item), writeable=False
        )
        out[first::up] = window @ by_phase[t % up]
    return out


def _wav_header(n_samples: int, sample_rate: int) -> bytes:
    data_size = n_samples * 2
    fmt = struct.pack("<HHIIHH", _PCM, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_size)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_size)
    )


def _read_wav(data: bytes, name: str) -> DecodedAudio:
    import numpy as np

    endian = "<" if data[:4] == b"RIFF" else ">"
    pos = 12
    fmt: tuple[int, int, int, int] | None = None
    payload: bytes | None = None
    while pos + 8 <= len(data):
        chunk_id = data[pos : pos + 4]
        (size,) = struct.unpack(endian + "I", data[pos + 4 : pos + 8])
        body = data[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, _, bits = struct.unpack(endian + "HHIIHH", body[:16])
            if tag == _EXTENSIBLE and len(body) >= 26:
                (tag,) = struct.unpack(endian + "H", body[24:26])
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            payload = body  # a truncated stream keeps what it has
            break
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise AudioDecodeError(f"{name}: malformed WAV file (no fmt or data chunk)")
    tag, channels, rate, bits = fmt
    if channels < 1 or rate < 1:
        raise AudioDecodeError(f"{name}: malformed WAV file ({channels} channels at {rate} Hz)")
    width = bits // 8
    frame = width * channels
    if width < 1 or frame == 0:
        raise AudioDecodeError(f"{name}: unsupported WAV sample size ({bits} bits)")
    payload = payload[: len(payload) - len(payload) % frame]
    if tag == _FLOAT and width in (4, 8):
        samples = np.frombuffer(payload, dtype=f"{endian}f{width}").astype(np.float32)
    elif tag == _PCM and width == 1:
        samples = (np.frombuffer(payload, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and width in (2, 4):
        raw = np.frombuffer(payload, dtype=f"{endian}i{width}")
        samples = raw.astype(np.float32) / float(2 ** (bits - 1))
    elif tag == _PCM and width == 3:
        triples = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        if endian == ">":
            triples = triples[:, ::-1]
        value = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        value = np.where(value >= 1 << 23, value - (1 << 24), value)
        samples = value.astype(np.float32) / float(1 << 23)
    else:
        raise AudioDecodeError(
            f"{name}: unsupported WAV encoding (format tag {tag}, {bits} bits); "
            "use PCM or IEEE float"
        )
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    return DecodedAudio(np.ascontiguousarray(samples, dtype=np.float32), rate)


def _soundfile_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("soundfile") is not None


def _read_soundfile(data: bytes, name: str) -> DecodedAudio:
    import numpy as np
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as exc:
        raise AudioDecodeError(f"{name}: cannot decode audio ({_first_line(exc)})") from exc
    return DecodedAudio(np.ascontiguousarray(samples.mean(axis=1), dtype=np.float32), int(rate))


def _read_ffmpeg(data: bytes, sample_rate: int, name: str, kind: str) -> DecodedAudio:
    import numpy as np

    ffmpeg = find_ffmpeg()
    what = f"{kind} audio"
    if ffmpeg is None:
        native = "WAV" if not _soundfile_available() else "WAV and FLAC"
        raise AudioDecodeError(
            f"{name}: cannot decode {what}: ffmpeg is not installed ({native} are read natively)"
        )
    command = [ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error"]
    command += input_args(kind, "pipe:0")
    command += ["-f", "f32le", "-acodec", "pcm_f32le", "-ac", "1", "-ar", str(sample_rate)]
    try:
        done = subprocess.run(
            [*command, "pipe:1"], input=data, capture_output=True, timeout=_FFMPEG_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AudioDecodeError(f"{name}: ffmpeg failed ({_first_line(exc)})") from exc
    if done.returncode != 0:
        message = done.stderr.decode("utf-8", "replace").strip() or f"exit {done.returncode}"
        raise AudioDecodeError(f"{name}: cannot decode {what} ({message.splitlines()[-1]})")
    samples = np.frombuffer(done.stdout[: len(done.stdout) // 4 * 4], dtype="<f4")
    return DecodedAudio(samples.astype(np.float32), sample_rate)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
