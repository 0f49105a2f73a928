"""A request the engine holds, from the queue to its last event, and where its events go."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings

if TYPE_CHECKING:
    from mlxcel.engine.text.detokenizer import IncrementalDetokenizer
    from mlxcel.engine.text.loop_detection import LoopDetector
    from mlxcel.engine.text.stops import StopMatcher

EventSink = Callable[[GenerationEvent], None]
"""Receives a request's events on the engine thread. A sink may also have a `flush()`
method: the engine then calls it once after each loop iteration in which the sink got
events (see `TextEngine.flushes_sinks`), so a sink can hold events and wake its reader
once per decode step instead of once per event."""


@dataclass
class RunningSequence:
    """A request the engine holds, from the queue to its last event."""

    request: GenerationRequest
    sink: EventSink
    max_tokens: int
    submitted: float = field(default_factory=time.perf_counter)
    uid: int = -1
    slot: int = -1
    admitted: float = 0.0
    first_token: float = 0.0
    cache_n: int = 0  # prompt tokens found in the prompt cache
    start_n: int = 0  # prompt tokens already in the KV cache the sequence starts from
    n_generated: int = 0
    prefilled: bool = False
    detok: IncrementalDetokenizer | None = None
    stopper: StopMatcher | None = None
    loop: LoopDetector | None = None
    started: bool = False  # in the batch, or prefilling alone to join it (a started sequence)
    finished: bool = False
    flush: Callable[[], None] | None = None  # the sink's `flush`, if it has one
    sampler: Any = None
    row: Any = None  # sampling.batched.RowSampling when the engine samples batched
    spec: Any = None  # speculative.lane.SequenceSpeculation when the request may speculate
    processors: list[Any] = field(default_factory=list)  # its logits processors
    prefilling_alone: bool = False  # its starting KV cache is built outside the batch first
    position_delta: int = 0  # a vision row's position shift after its media (mRoPE)
    progress_sent: int = -1  # the last prefill progress reported (`processed`)
    prefill_done: int = 0  # uncached prompt tokens the generator has prefilled

    def kv_tokens(self, n_generated: int) -> int:
        """Tokens in this sequence's KV cache once it has generated `n_generated` tokens:
        its prompt and every generated token but the last (not fed back yet); while it
        prefills, the cached prefix and the chunks done so far."""
        n_prompt = len(self.request.prompt_tokens)
        if n_generated > 0:
            return n_prompt + n_generated - 1
        return min(n_prompt, self.start_n + self.prefill_done)

    def timings(self, end: float) -> Timings:
        """The request's timings as of `end` (the prompt's end at its first token)."""
        first = self.first_token or end
        return Timings(
            prompt_n=len(self.request.prompt_tokens) - self.cache_n,
            prompt_ms=(first - self.admitted) * 1000 if self.admitted else 0.0,
            predicted_n=self.n_generated,
            predicted_ms=(end - first) * 1000,
            cache_n=self.cache_n,
        )
