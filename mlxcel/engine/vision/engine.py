"""`VisionEngine`: mlx-vlm generation behind the engine's submit/cancel/snapshot interface.

One slot: requests run one after another on the engine thread (mlx-vlm's multimodal prefill
is per sequence). Sampling, logits processors, grammar, stop strings, detokenization and the
events are mlxcel's own, the same as in `TextEngine`. With `sleep=` the engine unloads the
network after an idle spell and reloads it for the next request, as `TextEngine` does
(`mlxcel.engine.text.sleep`); the processor and tokenizer stay.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from mlxcel.engine.errors import InvalidRequestError, QueueFullError
from mlxcel.engine.process_memory import release_memory
from mlxcel.engine.text.memory_budget import AdmissionControl
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings, TokenLogprob
from mlxcel.engine.text.scheduler import EngineCounters, EngineSnapshot, EventSink, SlotState
from mlxcel.engine.text.sleep import (
    IdleSleep,
    Sleeps,
    reload_error,
    report_sleep,
    report_wake,
    resolve,
)
from mlxcel.engine.text.submission import iterate_events, token_budget
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
from mlxcel.engine.vision.loader import LoadedVisionModel

log = logging.getLogger(__name__)


@dataclass
class PreparedPrompt:
    """Model inputs of one request: expanded token ids and the processor's tensors."""

    tokens: list[int]
    input_ids: Any
    pixel_values: Any
    mask: Any
    extra: dict[str, Any]
    digest: str


@dataclass
class _Job:
    request: GenerationRequest
    sink: EventSink
    prepared: PreparedPrompt
    max_tokens: int
    submitted: float = field(default_factory=time.perf_counter)


class VisionEngine(Sleeps):
    """Generation over one mlx-vlm model, one request at a time."""

    flushes_sinks = False
    prompt_cache = None  # media prompts are never shared through the text prefix cache

    def __init__(
        self,
        loaded: LoadedVisionModel,
        *,
        context_per_slot: int | None = None,
        max_queue_depth: int = 64,
        max_images: int = 16,
        sleep: IdleSleep | None = None,
    ) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.n_slots = 1
        self.context_per_slot = context_per_slot or loaded.info.context_length
        self.max_queue_depth = max_queue_depth
        self.max_images = max_images
        self.counters = EngineCounters()
        self.memory = AdmissionControl(lambda: self.loaded.model)
        self._cond = threading.Condition()
        self._pending: list[tuple[int, int, _Job]] = []
        self._seq = itertools.count()
        self._jobs: dict[str, _Job] = {}
        self._running: _Job | None = None
        self._n_decoded = 0
        self._cancelled: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._prepare_lock = threading.Lock()
        self._sleep = sleep  # sleeping on idle (`--sleep-idle-seconds`); None: never

    # ---------------------------------------------------------------- public API

    @property
    def modalities(self) -> frozenset[str]:
        return self.loaded.modalities

    def start(self) -> VisionEngine:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxcel-vision", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the engine thread; queued and running requests end as cancelled."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._end_sleep()

    def check_media(self, inputs: VisionInputs) -> None:
        """Refuse media kinds this model does not take (InvalidRequestError, a 400)."""
        kinds = self.loaded.modalities
        if inputs.images and "image" not in kinds:
            raise InvalidRequestError("this model does not accept image inputs")
        if inputs.videos and "video" not in kinds:
            raise InvalidRequestError("this model does not accept video inputs")
        if inputs.audio and "audio" not in kinds:
            raise InvalidRequestError("this model does not accept audio inputs")
        if inputs.videos and inputs.audio and self.loaded.info.architecture != "gemma4_unified":
            raise InvalidRequestError("Combined video and audio inputs are not supported")
        if len(inputs.images) > self.max_images:
            raise InvalidRequestError(f"at most {self.max_images} images per request")

    def prepare(self, prompt: VisionPrompt) -> PreparedPrompt:
        """Run the model's processor on the prompt and media (placeholders expanded), once:
        the result is kept on `prompt`. Thread-safe; a server calls it on a worker thread
        before `submit`, since resizing a large picture takes seconds."""
        if isinstance(prompt.prepared, PreparedPrompt):
            return prompt.prepared
        from mlx_vlm import prepare_inputs

        self.check_media(prompt.inputs)
        inputs = prompt.inputs
        with self._prepare_lock:  # processors keep state; one call at a time
            try:
                out = prepare_inputs(
                    self.loaded.processor,
                    images=inputs.images or None,
                    audio=inputs.audio or None,
                    videos=inputs.videos or None,
                    prompts=[prompt.text],
                    add_special_tokens=False,
                    padding=False,
                )
            except (ValueError, TypeError, IndexError, KeyError) as exc:
                raise InvalidRequestError(f"the media could not be prepared: {exc}") from exc
            # Materialize here: a lazy graph built on this thread cannot be evaluated on the
            # engine thread (MLX streams are per thread).
            import mlx.core as mx

            mx.eval([v for v in out.values() if isinstance(v, mx.array)])
        input_ids = out["input_ids"]
        tokens = [int(t) for t in input_ids.reshape(-1).tolist()]
        extra = {
            k: v for k, v in out.items() if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        prompt.prepared = PreparedPrompt(
            tokens=tokens,
            input_ids=input_ids,
            pixel_values=out.get("pixel_values"),
            mask=out.get("attention_mask"),
            extra=extra,
            digest=inputs.digest(),
        )
        return prompt.prepared

    def check(self, request: GenerationRequest) -> int:
        """Validate `request` against the context; return its token budget."""
        return token_budget(request, self.context_per_slot)

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue `request` (its `media` a VisionPrompt, or None for text only)."""
        media = request.media
        if media is None:
            media = VisionPrompt(self.tokenizer.decode(request.prompt_tokens), VisionInputs())
        if not isinstance(media, VisionPrompt):
            raise InvalidRequestError("a vision request carries a VisionPrompt")
        prepared = self.prepare(media)
        request.prompt_tokens = list(prepared.tokens)
        budget = self.check(request)
        self.memory.admit(len(request.prompt_tokens), budget)  # RequestMemoryBudgetError
        job = _Job(request=request, sink=sink, prepared=prepared, max_tokens=budget)
        with self._cond:
            if self._stopping:
                raise QueueFullError("the engine is shutting down")
            if len(self._pending) >= self.max_queue_depth:
                raise QueueFullError("the queue is full")
            if request.request_id in self._jobs:
                raise InvalidRequestError(f"duplicate request id {request.request_id}")
            self._jobs[request.request_id] = job
            if self._sleep is not None:
                self._sleep.touch()
            heapq.heappush(self._pending, (int(request.priority), next(self._seq), job))
            self._cond.notify_all()
        self.start()

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; a running one stops at its next token."""
        with self._cond:
            if request_id in self._jobs:
                self._cancelled.add(request_id)
                self._cond.notify_all()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Submit `request` and yield its events in order (for the CLI and tests)."""
        yield from iterate_events(self.submit, self.cancel, request)

    def snapshot(self) -> EngineSnapshot:
        """The one slot, the queue and the counters as of now."""
        with self._cond:
            job = self._running
            slot = SlotState(
                id=0,
                state="decoding" if job is not None else "idle",
                request_id=job.request.request_id if job is not None else None,
                n_prompt=len(job.request.prompt_tokens) if job is not None else 0,
                n_decoded=self._n_decoded if job is not None else 0,
                used=job is not None or self.counters.requests_total > 0,
            )
            queued = tuple(j.request.request_id for _, _, j in sorted(self._pending))
            return EngineSnapshot((slot,), queued, self.counters, self.context_per_slot)

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        import mlx.core as mx

        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._pending:
                        if not self._idle_wait():
                            break
                    if self._stopping:
                        for _, _, job in self._pending:
                            self._finish(job, "cancelled", Timings())
                        self._pending.clear()
                        return
                    transition = self._sleep_due(busy=bool(self._pending))
                if transition == "sleep":
                    self._fall_asleep()
                    continue
                if transition == "wake":
                    self._wake_up()
                    continue
                with self._cond:
                    if not self._pending:
                        continue
                    _, _, job = heapq.heappop(self._pending)
                    if job.request.request_id in self._cancelled:
                        self._cancelled.discard(job.request.request_id)
                        self._forget(job)
                        self._finish(job, "cancelled", Timings())
                        continue
                    self._running = job
                    self._n_decoded = 0
                try:
                    self._generate(job)
                except Exception as exc:  # one request's failure must not stop the engine
                    log.exception("vision generation failed")
                    self._finish(job, "error", Timings(), error=str(exc) or type(exc).__name__)
                finally:
                    with self._cond:
                        self._running = None
                        self._cancelled.discard(job.request.request_id)
                        self._forget(job)
                        if self._sleep is not None:
                            self._sleep.touch()
                    del job  # nothing of a finished request outlives it into a sleep
        finally:
            mx.clear_streams()

    def _fall_asleep(self) -> None:
        """Engine thread: free the network (the processor and tokenizer stay)."""
        assert self._sleep is not None
        before = self._before_unload()
        self.loaded = replace(self.loaded, model=None)
        release_memory()
        report_sleep(log, self._sleep.seconds, before)

    def _wake_up(self) -> None:
        """Engine thread: load the network again; on failure the waiting requests fail and
        the engine stays asleep."""
        assert self._sleep is not None
        started = time.perf_counter()
        try:
            self.loaded = replace(self.loaded, model=self._sleep.reload().model)
        except Exception as exc:  # noqa: BLE001 - the server stays up, asleep
            log.exception("reloading the model after sleeping failed")
            error = reload_error(exc)
            with self._cond:
                jobs = [job for _, _, job in self._pending]
                self._pending.clear()
                for job in jobs:
                    self._forget(job)
                waiters = self._sleep.woke(error)
            for job in jobs:
                self._finish(job, "error", Timings(), error=str(error))
            resolve(waiters, error)
            return
        with self._cond:
            waiters = self._sleep.woke()
        resolve(waiters)
        report_wake(log, started)

    def _forget(self, job: _Job) -> None:
        self._jobs.pop(job.request.request_id, None)

    def _is_cancelled(self, job: _Job) -> bool:
        with self._cond:
            return job.request.request_id in self._cancelled or self._stopping

    def _generate(self, job: _Job) -> None:
        from mlx_vlm.generate import generate_step

        from mlxcel.engine.sampling.chain import make_sampling
        from mlxcel.engine.text.stops import StopMatcher

        request = job.request
        prepared = job.prepared
        timings = Timings(prompt_n=len(prepared.tokens))
        self.counters.requests_total += 1
        self.counters.sequences_started += 1
        if job.max_tokens == 0:
            self._finish(job, "length", timings)
            return
        sampler, processors = make_sampling(request.sampling, self.tokenizer.vocab_size)
        if request.grammar is not None:
            from mlxcel.engine.grammar import grammar_processor

            processors = [*processors, grammar_processor(request.grammar)]
        if request.thinking is not None:
            processors = [*processors, request.thinking.processor(self.tokenizer)]
        detok = self.tokenizer.detokenizer(prepared.tokens, skip_special=request.skip_special)
        stopper = StopMatcher(request.stop) if request.stop else None
        eos = () if request.ignore_eos else self.tokenizer.eos_token_ids
        started = time.perf_counter()
        first: float | None = None
        steps = generate_step(
            prepared.input_ids,
            self.loaded.model,
            prepared.pixel_values,
            prepared.mask,
            max_tokens=job.max_tokens,
            sampler=sampler,
            logits_processors=processors or None,
            **prepared.extra,
        )
        n = 0
        reason = "length"
        stop_word: str | None = None
        for token_array, logprobs in steps:
            now = time.perf_counter()
            if first is None:
                first = now
                timings.prompt_ms = (now - started) * 1000
            token = int(token_array)
            if self._is_cancelled(job):
                reason = "cancelled"
                break
            if token in eos:
                reason = "stop"
                break
            n += 1
            self._n_decoded = n
            text = detok.add(token)
            hit = False
            if stopper is not None and text:
                text, hit = stopper.feed(text)
            items: tuple[TokenLogprob, ...] = ()
            if request.logprobs is not None and request.post_sampling_probs:
                from mlxcel.engine.sampling.samplers import post_sampling_of

                got = post_sampling_of(request.sampling, logprobs, token, request.logprobs, sampler)
                items = (TokenLogprob(token, got[0], got[1]),)
            elif request.logprobs is not None:
                items = (self._logprob(logprobs, token, request.logprobs),)
            self._emit(job, text, token, items, len(prepared.tokens), n)
            if hit:
                reason = "stop"
                stop_word = stopper.matched if stopper is not None else None
                break
            if n >= job.max_tokens:
                break
        if first is not None:
            timings.predicted_ms = (time.perf_counter() - first) * 1000
        timings.predicted_n = n
        tail = ""
        if reason != "cancelled" and stop_word is None:
            tail = detok.flush()
            if stopper is not None:
                held, hit = stopper.feed(tail) if tail else ("", False)
                tail = held if hit else held + stopper.flush()
        c = self.counters
        c.prompt_tokens_total += len(prepared.tokens)
        c.completion_tokens_total += n
        c.decode_tokens_total += n
        c.prefill_tokens_total += len(prepared.tokens)
        c.generation_seconds_total += time.perf_counter() - started
        c.sequences_completed += 1
        self._finish(job, reason, timings, tail=tail, stop_word=stop_word, completion=n)

    @staticmethod
    def _logprob(row: Any, token: int, top_n: int) -> TokenLogprob:
        import mlx.core as mx

        row = row.reshape(-1)
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            k = min(top_n, row.shape[-1])
            idx = mx.argpartition(-row, kth=k - 1)[:k]
            ids: list[int] = idx.tolist()  # type: ignore[assignment]
            vals: list[float] = row[idx].tolist()  # type: ignore[assignment]
            top = tuple(sorted(zip(ids, vals, strict=True), key=lambda p: -p[1]))
        return TokenLogprob(token, float(row[token].item()), top)

    def _emit(
        self,
        job: _Job,
        text: str,
        token: int,
        logprobs: tuple[TokenLogprob, ...],
        n_prompt: int,
        n: int,
    ) -> None:
        job.sink(
            GenerationEvent(
                request_id=job.request.request_id,
                text=text,
                token_ids=(token,),
                logprobs=logprobs,
                prompt_tokens=n_prompt,
                completion_tokens=n,
                slot=0,
            )
        )

    def _finish(
        self,
        job: _Job,
        reason: Any,
        timings: Timings,
        *,
        tail: str = "",
        stop_word: str | None = None,
        completion: int = 0,
        error: str | None = None,
    ) -> None:
        job.sink(
            GenerationEvent(
                request_id=job.request.request_id,
                text=tail,
                finish_reason=reason,
                prompt_tokens=len(job.prepared.tokens),
                completion_tokens=completion,
                timings=timings,
                error=error,
                slot=0,
                stop_word=stop_word,
            )
        )
