"""A generated token's log-probabilities as its event reports them (`logprobs`, `top_n`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.request import TokenLogprob

if TYPE_CHECKING:
    from mlxcel.engine.text.running_sequence import RunningSequence


IMPOSSIBLE_LOGPROB = -9999.0
"""The log-probability reported for a token the distribution gives none (OpenAI's value)."""


def token_logprobs(job: RunningSequence, row: Any, token: int) -> tuple[TokenLogprob, ...]:
    """`token`'s log-probability and the request's top alternatives, from the step's
    log-probability `row` (before sampling) or, with `post_sampling_probs`, under the
    distribution the sampler drew it from; none when the request asks for none."""
    request = job.request
    top_n = request.logprobs
    if top_n is None:
        return ()
    if request.post_sampling_probs:
        got = job.row.take_post(token) if job.row is not None else None
        if got is None:
            from mlxcel.engine.sampling.samplers import post_sampling_of

            got = post_sampling_of(request.sampling, row, token, top_n, job.sampler)
        return (TokenLogprob(token, got[0], got[1]),)
    return (_pre_sampling(row, token, top_n),)


def _pre_sampling(row: Any, token: int, top_n: int) -> TokenLogprob:
    import mlx.core as mx

    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        k = min(top_n, row.shape[-1])
        idx = mx.argpartition(-row, kth=k - 1)[:k]
        ids: list[int] = idx.tolist()  # type: ignore[assignment]
        vals: list[float] = row[idx].tolist()  # type: ignore[assignment]
        # A token the grammar or a -inf logit bias rules out is no alternative (and -inf
        # is no JSON number): fewer than `top_n` come back when fewer are possible.
        possible = [(i, v) for i, v in zip(ids, vals, strict=True) if math.isfinite(v)]
        top = tuple(sorted(possible, key=lambda p: -p[1]))
    logprob = float(row[token].item())
    # A forced token (the thinking budget's end) may be one the row ruled out: OpenAI's floor.
    return TokenLogprob(token, logprob if math.isfinite(logprob) else IMPOSSIBLE_LOGPROB, top)
