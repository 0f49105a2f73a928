"""The audio worker: one thread that owns the Whisper and Kokoro models, one job at a time.

Jobs wait in a bounded queue (`queue_depth`; a full queue raises QueueFullError at once, which
the server answers with 503). Each job has a deadline (`timeout`): past it the job fails with
WorkerTimeoutError (504), dropped if it has not started, stopped at its next window
(transcription) or chunk (speech) if it has. Results come back through a `StoppableFuture`:
cancelling it stops the job the same way (its caller went away). The server awaits these
futures without touching MLX; the thread has its own MLX stream and never blocks the text
engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from mlxcel.engine.errors import EngineError, ModelLoadError, QueueFullError
from mlxcel.engine.mlx_threads import ThreadRun, run_pooled
from mlxcel.engine.workers import live_workers
from mlxcel.engine.workers.errors import (
    WorkerCrashedError,
    WorkerStoppedError,
    WorkerTimeoutError,
)
from mlxcel.engine.workers.job_queue import JobQueue
from mlxcel.engine.workers.stoppable_future import StoppableFuture

if TYPE_CHECKING:
    import numpy as np

    from mlxcel.engine.audio.transcribe import Transcription, TranscriptionOptions
    from mlxcel.engine.audio.tts import KokoroModel, Speech
    from mlxcel.engine.audio.whisper import WhisperModel

log = logging.getLogger(__name__)

DEFAULT_AUDIO_QUEUE_DEPTH = 8
DEFAULT_AUDIO_TIMEOUT = 600.0

T = TypeVar("T")


class AudioUnavailableError(EngineError):
    """The worker has no model for this kind of request (maps to HTTP 501)."""


@dataclass
class AudioModels:
    """The models a worker owns; None where that use is off."""

    stt: WhisperModel | None = None
    tts: KokoroModel | None = None


@dataclass
class AudioWorkerStats:
    """Counters the worker keeps (for /metrics and logs)."""

    jobs: int = 0
    failures: int = 0
    timeouts: int = 0
    busy_seconds: float = 0.0
    audio_seconds: float = 0.0  # of audio transcribed
    transcribe_seconds: float = 0.0  # spent transcribing it


@dataclass(frozen=True)
class TranscriptionProgress:
    """How far the running transcription is (seconds of audio done / in all)."""

    done_s: float
    total_s: float


@dataclass
class _AudioTask:
    """One transcription or speech call queued for the audio worker, with its deadline."""

    run: Callable[[AudioModels, Callable[[], bool]], Any]
    deadline: float | None
    future: StoppableFuture[Any] = field(default_factory=StoppableFuture)
    timed_out: bool = False

    def should_stop(self) -> bool:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.timed_out or self.future.stop_requested()


class AudioWorker:
    """A daemon thread serving transcription and speech jobs from a bounded queue.

    `stt_model` / `tts_model` are model references (`load_whisper` / `load_kokoro`); None
    leaves that use off. `loader` replaces the loading (tests pass ready models).
    """

    def __init__(
        self,
        *,
        stt_model: str | None = None,
        tts_model: str | None = None,
        store_dir: str | None = None,
        queue_depth: int = DEFAULT_AUDIO_QUEUE_DEPTH,
        timeout: float | None = DEFAULT_AUDIO_TIMEOUT,
        loader: Callable[[], AudioModels] | None = None,
        name: str = "mlxcel-audio",
    ) -> None:
        if queue_depth < 1:
            raise ValueError("audio queue depth must be at least 1")
        self.name = name
        self.stt_model = stt_model
        self.tts_model = tts_model
        self.store_dir = store_dir
        self.queue_depth = queue_depth
        self.timeout = timeout if timeout and timeout > 0 else None
        self.stats = AudioWorkerStats()
        self.models = AudioModels()
        self._loader = loader or self._load
        self._queue: JobQueue[_AudioTask] = JobQueue(queue_depth)
        self._thread: ThreadRun | None = None
        self._stopping = threading.Event()
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._progress: TranscriptionProgress | None = None

    # --- lifecycle -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def ready(self) -> bool:
        """True once the models are loaded and the thread serves jobs."""
        return self._loaded.is_set() and self._load_error is None and self.running

    @property
    def pending(self) -> int:
        """Jobs waiting in the queue (not counting the one running, nor cancelled ones)."""
        return self._queue.waiting

    def start(self, *, wait: bool = True) -> AudioWorker:
        """Start the thread, which loads the models first; with `wait`, block until they are
        loaded and raise ModelLoadError if that failed."""
        if not self.running:
            self._stopping.clear()
            self._loaded.clear()
            self._load_error = None
            self._thread = run_pooled(self._run, self.name)
            live_workers.track(self)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the models are loaded; re-raise the load error if there was one."""
        self._loaded.wait(timeout)
        if self._load_error is not None:
            error = self._load_error
            if isinstance(error, ModelLoadError):
                raise error
            raise ModelLoadError(f"audio model: {error}") from error

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop after the current job; jobs still queued fail with WorkerStoppedError."""
        self._stopping.set()
        self._queue.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._queue.drain(WorkerStoppedError(f"{self.name} stopped"))
        live_workers.untrack(self)

    # --- what the routes ask ---------------------------------------------------------

    @property
    def has_stt(self) -> bool:
        return self.models.stt is not None

    @property
    def has_tts(self) -> bool:
        return self.models.tts is not None

    def submit(self, run: Callable[[AudioModels, Callable[[], bool]], T]) -> StoppableFuture[T]:
        """Queue `run(models, should_stop)`; QueueFullError at once when the queue is full.

        The future fails with WorkerTimeoutError past the worker's timeout; cancelling it
        drops the job, or stops it at its next `should_stop()` if it runs.
        """
        if self._stopping.is_set() or not self.running:
            raise WorkerStoppedError(f"{self.name} is not running")
        deadline = time.monotonic() + self.timeout if self.timeout else None
        job = _AudioTask(run=run, deadline=deadline)
        if not self._queue.put(job):
            raise QueueFullError(f"{self.name}: {self.queue_depth} audio requests already waiting")
        return job.future

    @property
    def progress(self) -> TranscriptionProgress | None:
        """The running transcription's progress (updated after each 30-second window);
        None when no transcription is running."""
        return self._progress

    def transcribe(
        self,
        audio: np.ndarray,
        options: TranscriptionOptions,
        *,
        progress: Callable[[float, float], None] | None = None,
    ) -> StoppableFuture[Transcription]:
        """Queue a transcription of 16 kHz mono samples. `progress(done_s, total_s)` is called
        on the worker thread after each window (long audio is read 30 s at a time)."""
        return self.submit(self._transcription_job(audio, options, progress))

    def _transcription_job(
        self,
        audio: np.ndarray,
        options: TranscriptionOptions,
        progress: Callable[[float, float], None] | None,
    ) -> Callable[[AudioModels, Callable[[], bool]], Transcription]:
        from mlxcel.engine.audio.transcribe import SAMPLE_RATE, transcribe

        def report(done: float, total: float) -> None:
            self._progress = TranscriptionProgress(done, total)
            log.debug("%s: transcribed %.1f of %.1f s", self.name, done, total)
            if progress is not None:
                progress(done, total)

        def job(models: AudioModels, stop: Callable[[], bool]) -> Transcription:
            if models.stt is None:
                raise AudioUnavailableError("no speech-to-text model loaded")
            started = time.perf_counter()
            self._progress = TranscriptionProgress(0.0, len(audio) / SAMPLE_RATE)
            try:
                result = transcribe(models.stt, audio, options, progress=report, should_stop=stop)
            finally:
                self._progress = None
            elapsed = time.perf_counter() - started
            self.stats.audio_seconds += result.duration
            self.stats.transcribe_seconds += elapsed
            log.info(
                "%s: %.1f s of audio transcribed in %.2f s (%.1fx real time)",
                self.name,
                result.duration,
                elapsed,
                result.duration / elapsed if elapsed > 0 else float("inf"),
            )
            return result

        return job

    def speak(
        self, text: str, *, voice: str | None = None, speed: float = 1.0, phonemes: bool = False
    ) -> StoppableFuture[Speech]:
        """Queue a speech synthesis."""
        from mlxcel.engine.audio.tts import synthesize

        def job(models: AudioModels, stop: Callable[[], bool]) -> Speech:
            if models.tts is None:
                raise AudioUnavailableError("no text-to-speech model loaded")
            return synthesize(
                models.tts, text, voice=voice, speed=speed, phonemes=phonemes, should_stop=stop
            )

        return self.submit(job)

    # --- the thread ------------------------------------------------------------------

    def _load(self) -> AudioModels:
        models = AudioModels()
        if self.stt_model:
            from mlxcel.engine.audio.whisper import load_whisper

            models.stt = load_whisper(self.stt_model, store_dir=self.store_dir)
        if self.tts_model:
            from mlxcel.engine.audio.tts import load_kokoro

            models.tts = load_kokoro(self.tts_model)
        return models

    def _run(self) -> None:
        # On a pooled thread (`mlx_threads`), whose MLX streams stay for the next worker.
        try:
            self.models = self._loader()
        except BaseException as exc:  # reported by wait_ready
            self._load_error = exc
            log.error("%s: cannot load the audio models: %s", self.name, exc)
            return
        finally:
            self._loaded.set()
        while not self._stopping.is_set():
            job = self._queue.get()
            if job is None:
                break
            self._serve(job)

    def _serve(self, job: _AudioTask) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # abandoned while queued (its caller timed out or went away)
        if job.should_stop():
            self.stats.timeouts += 1
            job.future.set_exception(WorkerTimeoutError("the audio request timed out in the queue"))
            return
        started = time.perf_counter()
        try:
            result = job.run(self.models, job.should_stop)
        except Exception as exc:
            if job.timed_out:  # stopped at its deadline (TranscriptionCancelled, ...)
                self._time_out(job)
                return
            self.stats.failures += 1
            if not isinstance(exc, EngineError):
                log.exception("%s: job failed", self.name)
            job.future.set_exception(exc)
        except BaseException as exc:  # the job killed the worker: fail it and keep serving
            self.stats.failures += 1
            log.error("%s: worker died mid-request (%s); restarted", self.name, type(exc).__name__)
            job.future.set_exception(WorkerCrashedError(f"{self.name} died mid-request; restarted"))
        else:
            if job.timed_out:  # it returned after its deadline: what it made is cut short
                self._time_out(job)
                return
            self.stats.jobs += 1
            job.future.set_result(result)
        finally:
            self.stats.busy_seconds += time.perf_counter() - started

    def _time_out(self, job: _AudioTask) -> None:
        self.stats.timeouts += 1
        job.future.set_exception(WorkerTimeoutError.after(self.timeout or 0.0))
