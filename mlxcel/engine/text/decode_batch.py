"""Continuous batching that knows which sequence each sampled row is.

mlx-lm's `BatchGenerator` runs its prompt and decode batches privately: a shared sampler
gets `logprobs[B, V]` and no way to tell whose rows they are. `DecodeBatch` is the same
scheduling (the prompts fed `prefill_step_size` tokens per step, `prefill_batch_size` at a
time; every decoding sequence advanced by one batched forward per step; a sequence whose
prompt has one token left joins the decoding batch), written over mlx-lm's public
`PromptProcessingBatch` and `GenerationBatch`, whose `uids` say the rows of every call:
before each call that samples, `before_sampling(uids)` gets the rows it will sample, in
order (the decoding batch, then the sequences joining it); before each forward,
`before_forward(uids)` gets the rows it runs (a vision model's language model places each
row's positions by it). A sequence inserted without a cache gets one of `kv_type`
(`-ctk/-ctv`; None: mlx-lm's, in the model's dtype).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import (
    GenerationBatch,
    PromptProcessingBatch,
    StopSequences,
    generation_stream,
)
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.utils import maybe_set_recommended_wired_limit

from mlxcel.engine.text.kv_types import KVType, make_cache

_CLEAR_CACHE_EVERY = 512  # decode steps between MLX buffer-cache clears (as mlx-lm's)


@dataclass
class StepStats:
    """The work a `DecodeBatch` did over a `stats()` window."""

    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_steps: int = 0
    decode_time: float = 0.0


@dataclass
class _Waiting:
    """A sequence inserted and not yet in the prompt batch."""

    uid: int
    segments: list[list[int]]  # the prompt, its last token a segment of its own
    max_tokens: int
    cache: list[Any]
    all_tokens: list[int]
    sampler: Callable[[mx.array], mx.array]
    processors: list[Any]
    stop: StopSequences


class DecodeBatch:
    """`BatchGenerator`'s `insert`, `remove`, `next` and `stats`, with the rows of every
    sampler call told to `before_sampling` first."""

    def __init__(
        self,
        model: Any,
        *,
        completion_batch_size: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        before_sampling: Callable[[list[int]], None] | None = None,
        before_forward: Callable[[list[int]], None] | None = None,
        kv_type: KVType | None = None,
    ) -> None:
        self.model = model
        self.kv_type = kv_type
        self.prefill_batch_size = prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.prefill_step_size = prefill_step_size
        self._before_sampling = before_sampling
        self._before_forward = before_forward
        self._waiting: deque[_Waiting] = deque()
        self._prompts = PromptProcessingBatch.empty(
            model, greedy_sampler, prefill_step_size=prefill_step_size
        )
        # Per prompt-batch row: [segments left, tokens fed, prompt length].
        self._feeding: list[list[Any]] = []
        self._decoding = GenerationBatch.empty(model, greedy_sampler)
        self._next_uid = 0
        self._totals = StepStats()
        self._old_wired_limit = maybe_set_recommended_wired_limit()

    def close(self) -> None:
        """Restore the wired-memory limit this batch raised (if any)."""
        if self._old_wired_limit is not None:
            mx.synchronize(generation_stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None

    def __del__(self) -> None:
        self.close()

    @contextlib.contextmanager
    def stats(self) -> Iterator[StepStats]:
        """The work done while the block runs."""
        window = StepStats()
        before = StepStats(**vars(self._totals))
        try:
            yield window
        finally:
            for name, total in vars(self._totals).items():
                setattr(window, name, total - getattr(before, name))

    def insert(
        self,
        prompts: Sequence[list[int]],
        max_tokens: Sequence[int],
        caches: Sequence[list[Any] | None] | None = None,
        all_tokens: Sequence[list[int]] | None = None,
        samplers: Sequence[Callable[[mx.array], mx.array]] | None = None,
        logits_processors: Sequence[Sequence[Any]] | None = None,
        stop_sequences: Sequence[StopSequences] | None = None,
    ) -> list[int]:
        """Queue sequences (a prompt and its options each); their uids, in order."""
        n = len(prompts)
        caches = caches or [None] * n
        all_tokens = all_tokens or [[] for _ in range(n)]
        samplers = samplers or [greedy_sampler] * n
        logits_processors = [list(p or ()) for p in logits_processors or [()] * n]
        stop_sequences = stop_sequences or [StopSequences(None)] * n
        columns = (max_tokens, caches, all_tokens, samplers, logits_processors, stop_sequences)
        if any(len(c) != n for c in columns):
            raise ValueError("every option needs one entry per prompt")
        waiting: list[_Waiting] = []
        for prompt, m, cache, tokens, sampler, processors, stop in zip(
            prompts, *columns, strict=True
        ):
            uid = self._next_uid + len(waiting)
            if not prompt:
                raise ValueError(f"sequence {uid} has an empty prompt")
            if m <= 0:
                raise ValueError(f"sequence {uid}'s max_tokens must be > 0")
            segments = [list(prompt[:-1]), list(prompt[-1:])] if len(prompt) > 1 else [list(prompt)]
            if cache is None:
                cache = make_cache(self.model, self.kv_type)
            sampler = sampler or greedy_sampler
            waiting.append(_Waiting(uid, segments, m, cache, tokens, sampler, processors, stop))
        self._waiting.extend(waiting)
        self._next_uid += n
        return [w.uid for w in waiting]

    def remove(
        self, uids: Sequence[int], return_prompt_caches: bool = False
    ) -> dict[int, tuple[list[Any], list[int]]]:
        """Take sequences out wherever they are; with `return_prompt_caches`, each one's
        (KV cache, the tokens it holds) by uid."""
        gone = set(uids)
        caches: dict[int, tuple[list[Any], list[int]]] = {}
        if return_prompt_caches:
            for w in self._waiting:
                if w.uid in gone:
                    caches[w.uid] = (w.cache, w.all_tokens)
            for batch in (self._prompts, self._decoding):
                for i, uid in enumerate(batch.uids):
                    if uid in gone:
                        caches[uid] = (batch.extract_cache(i), batch.tokens[i])
        if any(w.uid in gone for w in self._waiting):
            self._waiting = deque(w for w in self._waiting if w.uid not in gone)
        keep = [i for i, uid in enumerate(self._prompts.uids) if uid not in gone]
        if len(keep) < len(self._prompts):
            self._prompts.filter(keep)
            self._feeding = [self._feeding[i] for i in keep]
        keep = [i for i, uid in enumerate(self._decoding.uids) if uid not in gone]
        if len(keep) < len(self._decoding):
            self._decoding.filter(keep)
        return caches

    def next(self) -> tuple[list[Any], list[Any]]:
        """One step: (prompt responses, generation responses), as `BatchGenerator.next`."""
        with mx.stream(generation_stream):
            return self._next()

    def _sampling(self, uids: list[int]) -> None:
        """Name the rows of the forward and the sampler call that come next."""
        if self._before_forward is not None:
            self._before_forward(list(uids))
        if self._before_sampling is not None:
            self._before_sampling(list(uids))

    def _next(self) -> tuple[list[Any], list[Any]]:
        totals = self._totals
        generated: list[Any] = []
        prompted: list[Any] = []
        if len(self._decoding) > 0:
            start = time.perf_counter()
            self._sampling(self._decoding.uids)
            generated = self._decoding.next()
            totals.decode_time += time.perf_counter() - start
            totals.generation_tokens += len(generated)
            totals.generation_steps += 1
            if totals.generation_steps % _CLEAR_CACHE_EVERY == 0:
                mx.clear_cache()
        if len(self._decoding) >= self.completion_batch_size:
            return prompted, generated
        n = min(
            self.prefill_batch_size - len(self._prompts),
            self.completion_batch_size - len(self._decoding),
            len(self._waiting),
        )
        if n > 0:
            self._prompts.extend(self._start_prompts(n))
        # Sequences whose prompt has one token left join the decoding batch.
        done = {i for i, (segments, _, _) in enumerate(self._feeding) if _last_token(segments)}
        if done:
            last = [self._feeding[i][0][0] for i in sorted(done)]
            lengths = [self._feeding[i][2] for i in sorted(done)]
            self._feeding = [f for i, f in enumerate(self._feeding) if i not in done]
            joining = self._prompts.split(sorted(done))
            self._sampling(joining.uids)
            batch = joining.generate(last)
            for uid, length in zip(batch.uids, lengths, strict=True):
                prompted.append(PromptProcessingBatch.Response(uid, (length, length), True, True))
            self._decoding.extend(batch)
        chunks = []
        for uid, feeding in zip(self._prompts.uids, self._feeding, strict=True):
            segments = feeding[0]
            chunk = segments[0][: self.prefill_step_size]
            segments[0] = segments[0][len(chunk) :]
            response = PromptProcessingBatch.Response(uid, (0, 0), False, False)
            if not segments[0]:
                segments.pop(0)
                response.end_of_segment = True
            feeding[1] += len(chunk)
            response.progress = (feeding[1], feeding[2])
            chunks.append(chunk)
            prompted.append(response)
        totals.prompt_tokens += sum(len(c) for c in chunks)
        if self._before_forward is not None and chunks:
            self._before_forward(list(self._prompts.uids))
        start = time.perf_counter()
        self._prompts.prompt(chunks)
        totals.prompt_time += time.perf_counter() - start
        return prompted, generated

    def _start_prompts(self, n: int) -> PromptProcessingBatch:
        """The next `n` waiting sequences as a prompt batch."""
        started = [self._waiting.popleft() for _ in range(n)]
        for w in started:
            self._feeding.append([w.segments, 0, sum(len(s) for s in w.segments)])
        return PromptProcessingBatch(
            model=self.model,
            uids=[w.uid for w in started],
            caches=[w.cache for w in started],
            tokens=[w.all_tokens for w in started],
            prefill_step_size=self.prefill_step_size,
            samplers=[w.sampler for w in started],
            fallback_sampler=greedy_sampler,
            logits_processors=[w.processors for w in started],
            stop_sequences=[w.stop for w in started],
            max_tokens=[w.max_tokens for w in started],
        )


def _last_token(segments: list[list[int]]) -> bool:
    """Whether a prompt's segments are down to its last token."""
    return len(segments) == 1 and len(segments[0]) == 1
