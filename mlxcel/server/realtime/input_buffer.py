"""A session's input audio buffer: `input_audio_buffer.append` chunks, decoded, bounded, and
watched by the turn detector when the session has `server_vad`.

Audio is kept at the client's rate (24 kHz PCM or 8 kHz G.711) and resampled to Whisper's
16 kHz once per turn; the detector hears each chunk resampled on its own. Times are
milliseconds since the session's first appended sample, as OpenAI's `audio_start_ms`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mlxcel.engine.audio.codec import resample
from mlxcel.engine.voice.vad import VAD_RATE, TurnDetector, VadEvent
from mlxcel.server.realtime.audio_wire import decode_audio, longer_than
from mlxcel.server.realtime.protocol import RATES, AudioFormat, ClientEventError

if TYPE_CHECKING:
    from mlxcel.server.realtime.protocol import TurnDetection

LEAD_MS = 500
"""Audio kept before the prefix padding while nobody speaks (the detector decides a start
a few frames after it)."""


class InputAudioBuffer:
    """Appended audio until a turn takes it; at most `max_seconds` of it."""

    def __init__(
        self, fmt: AudioFormat, max_seconds: float, turn_detection: TurnDetection | None
    ) -> None:
        self.max_seconds = max_seconds
        self._chunks: list[np.ndarray] = []
        self._samples = 0
        self._origin_ms = 0.0  # session time of the first sample held
        self.configure(fmt, turn_detection)

    def configure(self, fmt: AudioFormat, turn_detection: TurnDetection | None) -> None:
        """A new format or turn detection: what is buffered is dropped."""
        self.fmt = fmt
        self.rate = RATES[fmt]
        self.turn_detection = turn_detection
        self.detector = (
            TurnDetector(
                threshold=turn_detection.threshold,
                silence_ms=turn_detection.silence_duration_ms,
            )
            if turn_detection is not None
            else None
        )
        self.clear()
        self._detector_base = self.end_ms

    def session_ms(self, event: VadEvent) -> int:
        """The session time of a turn event."""
        return int(self._detector_base + event.ms)

    @property
    def ms(self) -> int:
        """Milliseconds of audio held."""
        return int(self._samples * 1000 / self.rate)

    @property
    def end_ms(self) -> float:
        """Session time just after the last sample held."""
        return self._origin_ms + self._samples * 1000 / self.rate

    def clear(self) -> None:
        """Drop what is held (the session clock goes on)."""
        self._origin_ms = self.end_ms if self._chunks else self._origin_ms
        self._chunks, self._samples = [], 0
        if self.detector is not None:
            self.detector.reset()

    def append(self, data: str) -> list[VadEvent]:
        """Add base64 audio; the turn events it completes (none without `server_vad`)."""
        if longer_than(data, self.fmt, self.max_seconds):
            raise self._full()
        samples = decode_audio(data, self.fmt)
        if self._samples + len(samples) > self.max_seconds * self.rate:
            raise self._full()
        if len(samples) == 0:
            return []
        if self.detector is not None and not self.detector.speaking:
            self._trim()  # before the new audio: a turn that stops in it is still whole
        self._chunks.append(samples)
        self._samples += len(samples)
        if self.detector is None:
            return []
        heard = resample(samples.astype(np.float32) / 32768.0, self.rate, VAD_RATE)
        return self.detector.feed(heard)

    def _full(self) -> ClientEventError:
        return ClientEventError(
            f"the input audio buffer is full: it holds at most {self.max_seconds:g} seconds;"
            " commit or clear it",
            code="input_audio_buffer_full",
            param="audio",
        )

    def _trim(self) -> None:
        """While nobody speaks, keep only the audio a start would need (prefix padding)."""
        prefix = self.turn_detection.prefix_padding_ms if self.turn_detection else 0
        keep = int((prefix + LEAD_MS) * self.rate / 1000)
        if self._samples <= keep * 2:
            return
        audio = self._joined()
        drop = len(audio) - keep
        self._origin_ms += drop * 1000 / self.rate
        self._chunks, self._samples = [audio[drop:]], keep

    def _joined(self) -> np.ndarray:
        if len(self._chunks) != 1:
            joined = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            self._chunks = [joined]
        return self._chunks[0]

    def take(self, start_ms: float | None = None, end_ms: float | None = None) -> np.ndarray:
        """The held audio from `start_ms` to `end_ms` (session times; None: the ends), as
        int16 at the format's rate; it and everything before it leave the buffer."""
        audio = self._joined()
        first = (
            0 if start_ms is None else max(0, int((start_ms - self._origin_ms) * self.rate / 1000))
        )
        last = len(audio) if end_ms is None else int((end_ms - self._origin_ms) * self.rate / 1000)
        last = max(first, min(len(audio), last))
        turn = audio[first:last].copy()
        self._origin_ms += last * 1000 / self.rate
        self._chunks, self._samples = [audio[last:]], len(audio) - last
        return turn
