"""Speech to text with a loaded Whisper model: samples in, text + timed segments/words out.

Decoding is mlx-whisper's (`mlx_whisper.transcribe`): 30-second windows, temperature
fallback, optional word timestamps from cross-attention alignment. This module feeds it an
already-loaded model, reports progress per window and can stop between windows.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from mlxcel.engine.errors import EngineError, InvalidRequestError

if TYPE_CHECKING:
    import numpy as np

    from mlxcel.engine.audio.whisper import WhisperModel

SAMPLE_RATE = 16_000
FRAMES_PER_SECOND = 100  # mel frames (hop 160 at 16 kHz)
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
TASKS = ("transcribe", "translate")

Task = Literal["transcribe", "translate"]
ProgressFn = Callable[[float, float], None]  # (seconds done, seconds total)

# mlx-whisper keeps its model in a class attribute and its progress bar in a module global:
# one transcription at a time per process.
_LOCK = threading.Lock()


class TranscriptionCancelled(EngineError):
    """The caller stopped a transcription between two windows."""


@dataclass(frozen=True)
class TranscriptionOptions:
    """What to do with the audio; `temperature` None or 0 means fallback from 0 upwards."""

    language: str | None = None
    task: Task = "transcribe"
    prompt: str | None = None
    temperature: float | None = None
    word_timestamps: bool = False


@dataclass(frozen=True)
class Word:
    """One word with its start and end in seconds."""

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class Segment:
    """One decoded segment, with the fields OpenAI's verbose_json reports."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] = field(default_factory=list)


@dataclass(frozen=True)
class Transcription:
    """The result of one transcription (or translation)."""

    text: str
    language: str  # ISO code, e.g. "en"
    duration: float  # seconds of input audio
    task: Task
    segments: list[Segment]

    @property
    def words(self) -> list[Word]:
        """Every word of every segment (empty unless word timestamps were asked for)."""
        return [word for segment in self.segments for word in segment.words]


def language_code(value: str | None) -> str | None:
    """The ISO code for a language code or English name ("en", "English"); None passes."""
    if value is None or not value.strip():
        return None
    from mlx_whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

    key = value.strip().lower()
    if key in LANGUAGES:
        return key
    if key in TO_LANGUAGE_CODE:
        return str(TO_LANGUAGE_CODE[key])
    raise InvalidRequestError(f"unknown language {value!r}; use an ISO-639-1 code such as 'en'")


def language_name(code: str) -> str:
    """The English name Whisper uses for `code` ("en" → "english")."""
    from mlx_whisper.tokenizer import LANGUAGES

    return str(LANGUAGES.get(code, code))


def transcribe(
    model: WhisperModel,
    audio: np.ndarray,
    options: TranscriptionOptions | None = None,
    *,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Transcription:
    """Transcribe (or translate to English) 16 kHz mono float32 `audio`.

    `progress(done_s, total_s)` is called after each 30-second window; when `should_stop()`
    turns true the work ends after the current window with TranscriptionCancelled.
    """
    import mlx.core as mx
    import numpy as np

    options = options or TranscriptionOptions()
    if options.task not in TASKS:
        raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, not {options.task!r}")
    language = language_code(options.language)
    if not model.multilingual and language not in (None, "en"):
        raise InvalidRequestError(
            f"{model.name} is an English-only model; it cannot take language {language!r}"
        )
    samples = np.ascontiguousarray(audio, dtype=np.float32)
    if samples.ndim != 1 or samples.size == 0:
        raise InvalidRequestError("audio must be a non-empty mono signal")
    temperature: float | tuple[float, ...] = (
        FALLBACK_TEMPERATURES if not options.temperature else float(options.temperature)
    )
    mw = importlib.import_module("mlx_whisper.transcribe")
    total = len(samples) / SAMPLE_RATE
    with _LOCK, _hooks(mw, total, progress, should_stop, options.word_timestamps):
        mw.ModelHolder.model = model.model
        mw.ModelHolder.model_path = f"mlxcel:{model.path}"
        mx.random.seed(0)  # fallback sampling is reproducible
        result = mw.transcribe(
            samples,
            path_or_hf_repo=f"mlxcel:{model.path}",
            verbose=None,
            temperature=temperature,
            initial_prompt=options.prompt or None,
            word_timestamps=options.word_timestamps,
            language=language,
            task=options.task,
            fp16=model.fp16,
        )
    if progress is not None:
        progress(total, total)  # windows count whole mel frames: end exactly at the length
    return _result(result, total, options.task)


def _result(result: dict[str, Any], duration: float, task: Task) -> Transcription:
    """mlx-whisper's dict as dataclasses; times clamped into the audio, NaN scores as 0."""

    def clamp(value: Any, low: float = 0.0) -> float:
        return round(min(max(_finite(value), low), duration), 3)

    segments = []
    for raw in result.get("segments", []):
        start = clamp(raw["start"])
        end = clamp(raw["end"], start)
        words = []
        for w in raw.get("words", []) or []:
            word_start = clamp(w["start"])
            words.append(
                Word(
                    word=str(w["word"]).strip(),
                    start=word_start,
                    end=clamp(w["end"], word_start),
                    probability=_finite(w.get("probability")),
                )
            )
        segments.append(
            Segment(
                id=int(raw["id"]),
                seek=int(raw["seek"]),
                start=start,
                end=end,
                text=str(raw["text"]),
                tokens=[int(t) for t in raw.get("tokens", [])],
                temperature=_finite(raw.get("temperature")),
                avg_logprob=_finite(raw.get("avg_logprob")),
                compression_ratio=_finite(raw.get("compression_ratio")),
                no_speech_prob=_finite(raw.get("no_speech_prob")),
                words=words,
            )
        )
    return Transcription(
        text=str(result.get("text", "")).strip(),
        language=str(result.get("language") or "en"),
        duration=round(duration, 3),
        task=task,
        segments=segments,
    )


def _finite(value: Any) -> float:
    number = float(value) if value is not None else 0.0
    return number if math.isfinite(number) else 0.0


class _Bar:
    """Stands in for mlx-whisper's tqdm bar: forwards progress, stops on request."""

    def __init__(
        self, total_s: float, progress: ProgressFn | None, should_stop: Callable[[], bool] | None
    ) -> None:
        self.total_s = total_s
        self.done_frames = 0
        self.progress = progress
        self.should_stop = should_stop

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, frames: int) -> None:
        self.done_frames += int(frames)
        if self.progress is not None:
            self.progress(min(self.done_frames / FRAMES_PER_SECOND, self.total_s), self.total_s)
        if self.should_stop is not None and self.should_stop():
            raise TranscriptionCancelled("transcription stopped")


class _TqdmModule:
    def __init__(self, bar: _Bar) -> None:
        self.bar = bar

    def tqdm(self, *args: Any, **kwargs: Any) -> _Bar:
        return self.bar


@contextmanager
def _hooks(
    module: Any,
    total_s: float,
    progress: ProgressFn | None,
    stop: Callable[[], bool] | None,
    word_timestamps: bool,
) -> Iterator[None]:
    """Route mlx-whisper's progress bar to `progress` and, for word timestamps, its DTW to
    numpy (no JIT warm-up). Without word timestamps its timing module stays unimported."""
    from mlxcel.engine.audio.dtw import dtw

    original_bar = module.tqdm
    module.tqdm = _TqdmModule(_Bar(total_s, progress, stop))
    timing: Any = None
    if word_timestamps:
        from mlxcel.engine.audio import lazy_timing

        timing = lazy_timing.real()
        original_dtw, timing.dtw = timing.dtw, dtw
    try:
        yield
    finally:
        module.tqdm = original_bar
        if timing is not None:
            timing.dtw = original_dtw
