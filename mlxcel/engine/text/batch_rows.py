"""Which sequence is which row when mlx-lm's `BatchGenerator` calls the shared sampler.

A `BatchSampler` (`mlxcel.engine.sampling.batched`) gets only `logprobs[B, V]`; this book
tells it, before every `BatchGenerator.next()`, whose rows each sampler call will hold. It
follows the generator from what the generator's public API says:

- the decoding batch keeps its rows in order: rows that finish (a response with a
  `finish_reason`) or are `remove`d drop out, and sequences whose prompt is done join at
  the end, in the order `next()` reports their `end_of_prompt`;
- a `next()` first samples the decoding batch (one call, when it holds rows), then the
  sequences whose prompt has one token left (one call, in insertion order), each prompt
  having been fed `prefill_step_size` tokens per step before that (its progress is in the
  prompt responses).

After every step `check` compares this book with what the generator reported (the order of
the responses, who ended their prompt, every queued call made) and raises `BatchRowsError`
at the first difference: that is the seam moving, and `tests/test_mlx_lm_seam.py` pins it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxcel.engine.sampling.batched import BatchRowsError, BatchSampler, RowSampling


class BatchRows:
    """The generator's rows as the engine knows them, and the calls each step will make."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler = sampler
        self.rows: dict[int, RowSampling] = {}
        self.decoding: list[int] = []  # uids in the decoding batch's order
        self.prompting: dict[int, int] = {}  # uid -> prompt tokens not fed yet (insertion order)
        self._expected: tuple[list[int], list[int]] = ([], [])

    def insert(self, uid: int, prompt_left: int, row: RowSampling) -> None:
        """A sequence `insert`ed with `prompt_left` prompt tokens for the generator to feed."""
        self.rows[uid] = row
        self.prompting[uid] = prompt_left

    def remove(self, uid: int) -> None:
        """A sequence taken out with `BatchGenerator.remove` (or one that finished)."""
        self.rows.pop(uid, None)
        self.prompting.pop(uid, None)
        if uid in self.decoding:
            self.decoding.remove(uid)

    def before_step(self) -> None:
        """Queue the sampler calls the next `BatchGenerator.next()` will make."""
        self.sampler.clear()
        decoding = list(self.decoding)
        joining = [uid for uid, left in self.prompting.items() if left <= 1]
        if decoding:
            self.sampler.expect([self.rows[uid] for uid in decoding])
        if joining:
            self.sampler.expect([self.rows[uid] for uid in joining])
        self._expected = (decoding, joining)

    def after_step(self, prompt_responses: Sequence[Any], responses: Sequence[Any]) -> None:
        """Check the step against the book (`BatchRowsError` if it differs), then update it."""
        decoding, joining = self._expected
        got = [r.uid for r in responses]
        if got != decoding:
            raise BatchRowsError(f"decoding rows were {got}, expected {decoding}")
        ended = [p.uid for p in prompt_responses if p.end_of_prompt]
        if ended != joining:
            raise BatchRowsError(f"prompts ending were {ended}, expected {joining}")
        if self.sampler.pending:
            raise BatchRowsError(f"{self.sampler.pending} queued sampler call(s) not made")
        for r in responses:
            if r.finish_reason is not None:
                self.rows.pop(r.uid, None)
        self.decoding = [r.uid for r in responses if r.finish_reason is None] + joining
        for uid in joining:
            del self.prompting[uid]
        for p in prompt_responses:
            if not p.end_of_prompt and p.uid in self.prompting:
                done, total = p.progress
                self.prompting[p.uid] = total - done

    def last_choice(self, uid: int) -> tuple[Any, Any] | None:
        """The token and log-probability row last sampled for `uid` (lazy), if known."""
        row = self.rows.get(uid)
        return None if row is None else self.sampler.last_choice(row)
