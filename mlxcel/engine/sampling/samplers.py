"""One request's own sampler, and what a draw of its was taken from.

A request's sampler is the sampling chain (`truncation`) run on a batch of one row, the same
code the decode batch's `BatchSampler` runs: a request draws the same tokens alone as in any
batch. Randomness comes from a per-request key (from `params.seed`, or a fresh random one)
split at every call, so the same seed, parameters and logits give the same tokens whatever
the global MLX random state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from mlxcel.engine.sampling.batched import BatchSampler, RowSampling
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.stages import (
    PostSampling,
    greedy_post_sampling,
    host_post_sampling,
    truncated_top,
)
from mlxcel.engine.sampling.truncation import (
    ChainSettings,
    adaptive_reshape,
    adaptive_target,
    candidates_of,
    initial_mu,
    mirostat_truncate,
    truncate,
)

Sampler = Callable[[mx.array], mx.array]

_NEG_INF = float("-inf")


def greedy(logprobs: mx.array) -> mx.array:
    """The most probable token of each row."""
    return mx.argmax(logprobs, axis=-1)


class RequestSampler:
    """`sampler(logprobs[B, V]) -> token ids[B]` for one request: the chain on its row (every
    row of a call draws with the request's key). `draw_states` keeps (token, state) of the
    last draws of a Mirostat or adaptive-p request (its mu or running average), for
    `post_sampling_of`."""

    __slots__ = ("_batch", "draw_states", "row")

    def __init__(self, params: SamplingParams) -> None:
        self.row = RowSampling(params)
        self._batch = BatchSampler()
        self.draw_states: deque[tuple[mx.array, mx.array]] = deque(maxlen=4)

    def __call__(self, logprobs: mx.array) -> mx.array:
        row = self.row
        state = row.mu if row.mu is not None else row.average
        tokens = self._batch.sample((row,), logprobs)
        if state is not None:
            self.draw_states.append((tokens, state))
        return tokens


def make_sampler(params: SamplingParams) -> Sampler:
    """The request's token sampler: greedy when temperature <= 0, else the sampling chain."""
    if params.temperature <= 0:
        return greedy
    return RequestSampler(params)


def _draw_state(sampler: Sampler | None, token: int, initial: float) -> mx.array:
    """The state (Mirostat's mu, adaptive-p's running average; [1, 1]) `sampler` drew
    `token` with: its oldest recorded draw of that token (earlier ones are dropped), or
    `initial` when it kept no such draw."""
    used = sampler.draw_states if isinstance(sampler, RequestSampler) else None
    while used:
        tokens, state = used.popleft()
        if int(tokens[0].item()) == token:  # type: ignore[arg-type]
            return state.reshape(1, 1)
    return mx.array([[initial]], dtype=mx.float32)


def _scatter(vals: mx.array, idx: mx.array | None, vocab: int) -> mx.array:
    """Candidates `vals` with token ids `idx` back in vocabulary order (others -inf)."""
    if idx is None:
        return vals
    full = mx.full((vals.shape[0], vocab), _NEG_INF, dtype=vals.dtype)
    return mx.put_along_axis(full, idx, vals, axis=-1)


def make_distribution(params: SamplingParams) -> Callable[..., mx.array]:
    """`distribution(logprobs, key=None) -> logprobs[B, V]` the sampler would draw from.

    Removed tokens are -inf; the rest are renormalized after the temperature. Greedy puts
    all the mass on the argmax. `key` only matters for XTC with 0 < probability < 1.
    Mirostat's and adaptive-p's are the first draw's (their state at its initial value).
    """
    settings = ChainSettings([params]) if params.temperature > 0 else None

    def distribution(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        rows, vocab = logprobs.shape
        if settings is None:
            best = mx.argmax(logprobs, axis=-1, keepdims=True)
            hot = mx.arange(vocab)[None, :] == best
            return mx.where(hot, 0.0, _NEG_INF)
        candidates = candidates_of(params, vocab)
        idx: mx.array | None
        if candidates[0] == "mirostat":
            mu = mx.full((rows, 1), initial_mu(params), dtype=mx.float32)
            vals, idx = mirostat_truncate(settings, logprobs, mu, candidates[1])
        else:
            vals, idx = truncate(settings, candidates, logprobs, key)
            target = adaptive_target(params)
            if target is not None:
                start = mx.full((rows, 1), target, dtype=mx.float32)
                vals, _ = adaptive_reshape(settings, vals, start)
        vals = _scatter(vals, idx, vocab)
        return vals - mx.logsumexp(vals, axis=-1, keepdims=True)

    return distribution


def post_sampling_of(
    params: SamplingParams,
    logprobs: mx.array,
    token: int,
    n: int,
    sampler: Sampler | None = None,
) -> PostSampling:
    """`PostSampling` of `token`, drawn from one row of log-probabilities `logprobs` with
    `params`, computed again from that row (for tokens no `BatchSampler` drew). Mirostat
    and adaptive-p take the state of the draw from `sampler` (the request's own
    `make_sampler` sampler).

    XTC with 0 < probability < 1 flips a coin per draw that is not known here: this takes a
    fresh coin, and the distribution without XTC when that one excludes `token` (which the
    draw itself then cannot have applied).
    """
    if params.temperature <= 0 or (params.top_k == 1 and not params.mirostat):
        return greedy_post_sampling(token, n)
    row = logprobs.reshape(1, -1)
    candidates = candidates_of(params, row.shape[-1])
    if candidates[0] == "mirostat":
        mu = _draw_state(sampler, token, initial_mu(params))
        kept, ids = mirostat_truncate(ChainSettings([params]), row, mu, candidates[1])
        position = mx.array([token]) if ids is None else mx.argmax(ids == token, axis=-1)
        drawn, best, best_ids = truncated_top(kept, ids, position, n, ordered=ids is not None)
        value = float(drawn.item())  # type: ignore[arg-type]
        return host_post_sampling(value, best_ids[0].tolist(), best[0].tolist(), n)  # type: ignore[arg-type]
    choice = mx.array([token])
    target = adaptive_target(params)
    average = None if target is None else _draw_state(sampler, token, target)
    for attempt in (params, replace(params, xtc_probability=0.0)):
        settings = ChainSettings([attempt])
        vals, idx = truncate(settings, candidates, row, None)
        if average is not None:
            vals, _ = adaptive_reshape(settings, vals, average)
        vals = _scatter(vals, idx, row.shape[-1])
        chosen, top, pos = truncated_top(vals, None, choice, n, ordered=False)
        value = float(chosen.item())  # type: ignore[arg-type]
        if value != _NEG_INF or attempt.xtc_probability == 0:
            break
    return host_post_sampling(value, pos[0].tolist(), top[0].tolist(), n)  # type: ignore[arg-type]
