"""The token pipeline that every model kind's sequences go through, from a sampled token to
the events a client sees.

A sequence's detokenizer, stop strings and loop detection are set up at admission
(`admit`); each token the batch or the speculative lane gives it goes through `token`:
the text it adds, stop strings held back and matched, loop detection, its
log-probabilities, its event (with timings when the request asks for them per token);
`token` says whether the sequence ends there (`Ending`). `progress` sends prefill progress
events; `finish` sends the final event (timings, draft statistics, the text still held
back) and `count_finish` adds a finished request to the counters. Sinks that got events
are flushed once per engine iteration (`flush_sinks`).

The engine core (`TextEngine`, and `VisionEngine` on it) owns the batch, the slots and the
prompt cache; this module knows none of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.engine_state import EngineCounters
from mlxcel.engine.text.request import (
    FinishReason,
    GenerationEvent,
    PromptProgress,
    TokenLogprob,
)
from mlxcel.engine.text.running_sequence import RunningSequence
from mlxcel.engine.text.token_logprobs import token_logprobs

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ending:
    """How a sequence ends after a token: its finish reason, the text it still held back,
    the stop string that matched, and whether the generator still holds the sequence (a
    stop string or a loop ended it; at an end-of-generation token or its length the
    generator has dropped it already)."""

    reason: FinishReason  # "stop" | "length"
    tail: str = ""
    stop_word: str | None = None
    in_generator: bool = False


class TokenPipeline:
    """Per-sequence text, stops, loop detection, log-probabilities and events."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._to_flush: set[Callable[[], None]] = set()  # engine thread only

    def admit(self, job: RunningSequence) -> None:
        """Set up `job`'s detokenizer (after its prompt), stop matcher and loop detector."""
        from mlxcel.engine.text.loop_detection import LoopDetector
        from mlxcel.engine.text.stops import StopMatcher

        request = job.request
        job.detok = self.tokenizer.detokenizer(
            request.prompt_tokens, skip_special=request.skip_special
        )
        job.stopper = StopMatcher(request.stop) if request.stop else None
        job.loop = LoopDetector(request.loop) if request.loop is not None else None

    def token(
        self, job: RunningSequence, token: int, finish_reason: str | None, row: Any, now: float
    ) -> Ending | None:
        """Take `token` into `job` (`finish_reason`: the generator's for it, `row`: the
        step's log-probabilities): its event goes out unless it ends the generation; the
        `Ending` when the sequence ends here, else None."""
        if job.n_generated == 0:
            job.first_token = now
            job.prefilled = True
        job.n_generated += 1
        detok = job.detok
        assert detok is not None  # set at admission
        if finish_reason == "stop":  # an end-of-generation token: not part of the output
            job.n_generated -= 1
            return Ending("stop", tail=detok.flush())
        text = detok.add(token)
        logprobs = token_logprobs(job, row, token)
        stopper = job.stopper
        if stopper is not None and text:
            text, stop_hit = stopper.feed(text)
            if stop_hit:
                self.emit(job, text, token, logprobs)
                return Ending("stop", stop_word=stopper.matched, in_generator=True)
        if job.loop is not None and job.loop.push(token):
            self.emit(job, text, token, logprobs)
            return Ending("stop", tail=self._flush_text(job), in_generator=True)
        self.emit(job, text, token, logprobs)
        if finish_reason == "length":
            return Ending("length", tail=self._flush_text(job))
        return None

    def emit(
        self, job: RunningSequence, text: str, token: int, logprobs: tuple[TokenLogprob, ...]
    ) -> None:
        """Send one token's event."""
        self._send(
            job,
            GenerationEvent(
                request_id=job.request.request_id,
                text=text,
                token_ids=(token,),
                logprobs=logprobs,
                slot=job.slot,
                timings=job.timings(time.perf_counter()) if job.request.timings_per_token else None,
            ),
        )

    def progress(self, job: RunningSequence, done: int, complete: bool = False) -> None:
        """Send a prefill progress event: `done` of the uncached prompt tokens processed
        (none when it would repeat the last one)."""
        total = len(job.request.prompt_tokens)
        processed = total if complete else min(total, job.start_n + done)
        if processed <= job.progress_sent:
            return
        job.progress_sent = processed
        elapsed = (time.perf_counter() - job.admitted) * 1000 if job.admitted else 0.0
        self._send(
            job,
            GenerationEvent(
                request_id=job.request.request_id,
                slot=job.slot,
                progress=PromptProgress(total, job.cache_n, processed, elapsed),
            ),
        )

    def finish(
        self,
        job: RunningSequence,
        reason: FinishReason,
        end: float,
        *,
        tail: str = "",
        error: str | None = None,
        stop_word: str | None = None,
    ) -> None:
        """Send `job`'s final event, its timings as of `end`."""
        timings = job.timings(end)
        spec = job.spec
        if spec is not None and spec.draft_rounds:
            timings.draft_n = spec.draft_n
            timings.draft_n_accepted = spec.draft_n_accepted
            timings.draft_rounds = spec.draft_rounds
            timings.draft_kind = spec.kind
        self._send(
            job,
            GenerationEvent(
                request_id=job.request.request_id,
                text=tail,
                finish_reason=reason,
                prompt_tokens=len(job.request.prompt_tokens),
                completion_tokens=job.n_generated,
                timings=timings,
                error=error,
                slot=job.slot,
                stop_word=stop_word,
            ),
        )

    def flush_sinks(self) -> None:
        """Call `flush()` once on every sink that got events since the last call."""
        if not self._to_flush:
            return
        flushes, self._to_flush = self._to_flush, set()
        for flush in flushes:
            try:
                flush()
            except Exception:  # a sink's failure must not stop the engine
                log.exception("event sink flush failed")

    def _send(self, job: RunningSequence, event: GenerationEvent) -> None:
        if job.flush is not None:
            self._to_flush.add(job.flush)
        job.sink(event)

    def _flush_text(self, job: RunningSequence) -> str:
        """The text `job` still holds back (detokenizer, then stop matcher)."""
        assert job.detok is not None  # set at admission
        tail = job.detok.flush()
        if job.stopper is not None:
            held, hit = job.stopper.feed(tail) if tail else ("", False)
            return held if hit else held + job.stopper.flush()
        return tail


def count_finish(
    counters: EngineCounters, job: RunningSequence, reason: FinishReason, end: float
) -> None:
    """Add a request that ended at `end` to `counters`: a cancelled one is not counted, and
    only a sequence that joined the batch (`job.started`) counts as a completed one."""
    if reason == "cancelled":
        return
    counters.requests_total += 1
    counters.sequences_completed += int(job.started)
    counters.prompt_tokens_total += len(job.request.prompt_tokens)
    counters.completion_tokens_total += job.n_generated
    counters.generation_seconds_total += end - (job.admitted or end)
    counters.n_tokens_max = max(
        counters.n_tokens_max, len(job.request.prompt_tokens) + job.n_generated
    )
