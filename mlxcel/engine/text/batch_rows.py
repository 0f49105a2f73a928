"""Whose sampling state each row of the decode batch is, for the shared `BatchSampler`.

A `BatchSampler` (`mlxcel.engine.sampling.batched`) gets only `logprobs[B, V]`; the engine's
`DecodeBatch` names the rows of every sampler call before it makes it (`before_sampling`),
and this book turns those uids into the rows' `RowSampling`s. Nothing is guessed: a uid the
book does not know is an engine bug (KeyError), not a change in mlx-lm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxcel.engine.sampling.batched import BatchSampler, RowSampling


class BatchRows:
    """The `RowSampling` of every sequence in the decode batch, by uid."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler = sampler
        self.rows: dict[int, RowSampling] = {}

    def insert(self, uid: int, row: RowSampling) -> None:
        """A sequence inserted into the decode batch."""
        self.rows[uid] = row

    def remove(self, uid: int) -> None:
        """A sequence taken out of the decode batch."""
        self.rows.pop(uid, None)

    def before_sampling(self, uids: Sequence[int]) -> None:
        """The next sampler call samples the rows of `uids`, in this order."""
        self.sampler.clear()
        self.sampler.expect([self.rows[uid] for uid in uids])

    def after_step(self, responses: Sequence[Any]) -> None:
        """Forget the sequences that finished in a step (the batch dropped them)."""
        for r in responses:
            if r.finish_reason is not None:
                self.rows.pop(r.uid, None)

    def last_choice(self, uid: int) -> tuple[Any, Any] | None:
        """The token and log-probability row last sampled for `uid` (lazy), if known."""
        row = self.rows.get(uid)
        return None if row is None else self.sampler.last_choice(row)
