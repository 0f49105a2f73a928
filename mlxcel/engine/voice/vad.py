"""Voice activity detection over a stream: where speech starts and where it stops.

WebRTC's VAD (the `webrtcvad-wheels` package: a small C library, no model file, no torch)
classifies 30 ms frames of 16 kHz audio as voiced or not. `TurnDetector` adds the turn
logic of OpenAI's `server_vad`: speech starts once most of the recent frames are voiced,
and stops after `silence_ms` of unvoiced frames. Times are milliseconds since the first
sample fed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

VAD_RATE = 16_000
FRAME_MS = 30
FRAME_SAMPLES = VAD_RATE * FRAME_MS // 1000
START_WINDOW = 8
"""Frames looked at to decide that speech started (240 ms)."""
START_VOICED = 6
"""Voiced frames among them that start speech."""


@dataclass(frozen=True)
class SpeechStarted:
    """Speech began at `ms` (the first voiced frame of the window that started it)."""

    ms: int


@dataclass(frozen=True)
class SpeechStopped:
    """Speech ended at `ms` (the end of its last voiced frame)."""

    ms: int


VadEvent = SpeechStarted | SpeechStopped


def aggressiveness(threshold: float) -> int:
    """OpenAI's `threshold` (0-1, higher needs louder speech) as WebRTC's mode (0-3)."""
    return max(0, min(3, int(threshold * 4)))


class TurnDetector:
    """Feed 16 kHz float samples as they come; get speech start and stop events."""

    def __init__(self, *, threshold: float = 0.5, silence_ms: int = 500) -> None:
        import webrtcvad

        self._vad = webrtcvad.Vad(aggressiveness(threshold))
        self.silence_frames = max(1, -(-silence_ms // FRAME_MS))
        self._pending = np.zeros(0, dtype=np.int16)
        self._frames = 0  # frames classified so far
        self._recent: deque[bool] = deque(maxlen=START_WINDOW)
        self.speaking = False
        self._last_voiced = 0  # frame index after the last voiced frame
        self._quiet = 0  # unvoiced frames in a row while speaking

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """The events the new `samples` (16 kHz, float in [-1, 1]) complete."""
        pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
        data = np.concatenate([self._pending, pcm])
        whole = len(data) // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = data[whole:]
        events: list[VadEvent] = []
        for start in range(0, whole, FRAME_SAMPLES):
            frame = data[start : start + FRAME_SAMPLES].tobytes()
            event = self._classified(self._vad.is_speech(frame, VAD_RATE))
            if event is not None:
                events.append(event)
        return events

    def _classified(self, voiced: bool) -> VadEvent | None:
        index = self._frames
        self._frames += 1
        self._recent.append(voiced)
        if voiced:
            self._last_voiced = index + 1
        if not self.speaking:
            if sum(self._recent) >= START_VOICED:
                self.speaking, self._quiet = True, 0
                first = index + 1 - len(self._recent) + list(self._recent).index(True)
                return SpeechStarted(first * FRAME_MS)
            return None
        self._quiet = 0 if voiced else self._quiet + 1
        if self._quiet >= self.silence_frames:
            self.speaking = False
            self._recent.clear()
            return SpeechStopped(self._last_voiced * FRAME_MS)
        return None

    def reset(self) -> None:
        """Forget the current speech (the buffer was cleared or committed by hand)."""
        self.speaking = False
        self._recent.clear()
        self._quiet = 0

    @property
    def heard_ms(self) -> int:
        """Milliseconds classified so far."""
        return self._frames * FRAME_MS
