"""One sampler for a whole decode batch: every row's settings as arrays in one graph.

mlx-lm's batch classes (under the engine's `DecodeBatch`) sample a batch in one call only
when every row holds the same sampler object; otherwise they call each row's sampler on
its own one-row slice (one small graph per request per step). `BatchSampler` is that one
shared object: before each call `DecodeBatch` names the rows the call will see and the
engine queues them (`expect`); the sampler runs the sampling chain (`truncation`) with each
row's settings as columns.

Rows are grouped by how their candidates are found (greedy; the top k for one k; the whole
vocabulary sorted; the whole vocabulary in its own order; Mirostat), and each group is one
batched graph. Inside a group each row draws with its own key, split as a lone row's key
is: a row samples the same tokens here as its request's own sampler (the same chain on a
batch of one row), whatever rows share the batch (so a seeded request stays reproducible
and greedy rows stay the argmax of their own row).

A row may also carry its request's logit bias (`RowSampling(..., logit_bias=True)`): it is
then added to the row's log-probabilities here, as one dense add per group, instead of by a
logits processor (any processor sends mlx-lm's step through a loop over the rows). The
result is the same distribution (the bias shifts logits and log-probabilities alike; every
stage after it is shift-invariant per row); only the log-probabilities mlx-lm reports then
come before the bias, so the engine folds the bias only for requests that do not ask for
log-probabilities.

A row may keep what it was drawn from (`RowSampling(..., post_probs=N)`, llama-server's
`post_sampling_probs`): the drawn token's probability and the N most probable candidates
left after every stage and the temperature. Each group computes them for its asking rows
only, in the same graph as the draw; the row keeps them until the engine reports that token
(`take_post`; mlx-lm reports a token one step after it is drawn, so up to two are held).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.processors import merge_logit_bias
from mlxcel.engine.sampling.stages import (
    PostSampling,
    adaptive_p_update,
    chosen_tokens,
    greedy_post_sampling,
    host_post_sampling,
    mirostat_update,
    truncated_top,
)
from mlxcel.engine.sampling.truncation import (
    COIN_KEYS,
    DRAW_KEYS,
    NEXT_KEYS,
    Candidates,
    ChainSettings,
    adaptive_reshape,
    adaptive_target,
    candidates_of,
    draw,
    initial_key,
    initial_mu,
    key_part,
    mirostat_truncate,
    split_keys,
    truncate,
)


class BatchRowsError(RuntimeError):
    """The batch the sampler was called on is not the rows the engine queued for it."""


class _PostBatch:
    """One group's post-sampling distributions of one call (lazy until first read)."""

    __slots__ = ("arrays", "host")

    def __init__(self, *arrays: mx.array) -> None:
        self.arrays = arrays  # (tokens [G]) greedy, or (tokens, chosen [G], top [G, n], ids)
        self.host: list[list[Any]] | None = None

    def report(self, j: int, n: int) -> tuple[int, PostSampling]:
        """Member `j`'s (token, `PostSampling` with up to `n` candidates)."""
        if self.host is None:
            self.host = [a.tolist() for a in self.arrays]  # type: ignore[misc]
        host = self.host
        token = int(host[0][j])
        if len(host) == 1:
            return token, greedy_post_sampling(token, n)
        return token, host_post_sampling(float(host[1][j]), host[3][j], host[2][j], n)


class RowSampling:
    """One request's sampling state inside a `BatchSampler`: its settings, random key and
    draw state (Mirostat's target, adaptive-p's running average)."""

    __slots__ = ("average", "bias", "key", "last", "mu", "params", "post", "post_n")

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int | None = None,
        *,
        logit_bias: bool = False,
        post_probs: int | None = None,
    ) -> None:
        """`logit_bias`: apply `params.logit_bias` here (ValueError for an id outside the
        `vocab_size` tokens); False: it is left to a logits processor. `post_probs`: keep,
        for every draw, the drawn token's probability and the `post_probs` most probable
        candidates of the distribution it was drawn from (`take_post`); None: not kept."""
        self.post_n = post_probs
        # At most two draws are outstanding: the one being reported and the one ahead of it.
        self.post: deque[tuple[_PostBatch, int]] = deque(maxlen=4)
        self.params = params
        self.bias: dict[int, float] = {}
        if logit_bias:
            if vocab_size is None:
                raise ValueError("a folded logit bias needs the vocabulary size")
            self.bias = merge_logit_bias(params.logit_bias, vocab_size)
        greedy = params.temperature <= 0
        self.key: mx.array | None = None if greedy else initial_key(params.seed)
        self.last: tuple[mx.array, mx.array, int] | None = None  # (tokens, logprobs, row)
        self.mu: mx.array | None = None  # Mirostat's target, [1]
        if params.mirostat and not greedy:
            self.mu = mx.array([initial_mu(params)], dtype=mx.float32)
        target = adaptive_target(params)
        # adaptive-p's running average, [1]; primed as if on target, as llama.cpp starts it
        self.average = None if target is None else mx.array([target], dtype=mx.float32)

    def take_post(self, token: int) -> PostSampling | None:
        """The post-sampling distribution of the oldest draw not taken yet, when that draw
        is `token` (else None, and every kept draw is dropped: they no longer line up)."""
        if not self.post or self.post_n is None:
            return None
        batch, j = self.post.popleft()
        drawn, report = batch.report(j, self.post_n)
        if drawn != token:
            self.post.clear()
            return None
        return report


@dataclass
class _Group:
    """Rows that find their candidates the same way: one batched graph per call."""

    candidates: Candidates
    rows: list[int]  # positions in the batch
    members: list[RowSampling]
    index: mx.array | None  # `rows` as an array; None when the group is the whole batch
    settings: ChainSettings | None  # None for greedy rows
    bias: mx.array | None = None  # [G, V] logit bias, when a member has one
    post: list[RowSampling] | None = None  # members keeping post-sampling distributions
    post_index: mx.array | None = None  # their positions in the group; None: all of it
    post_n: int = 0


def _dense_bias(members: list[RowSampling], vocab: int) -> mx.array:
    dense = np.zeros((len(members), vocab), dtype=np.float32)
    for i, member in enumerate(members):
        if member.bias:
            dense[i, list(member.bias)] = list(member.bias.values())
    return mx.array(dense)


def _build_group(
    candidates: Candidates, rows: list[int], members: list[RowSampling], n: int, vocab: int
) -> _Group:
    index = None if len(rows) == n else mx.array(rows, dtype=mx.int32)
    settings = None if candidates[0] == "greedy" else ChainSettings([m.params for m in members])
    group = _Group(candidates, rows, members, index, settings)
    if any(m.bias for m in members):
        group.bias = _dense_bias(members, vocab)
    post = [j for j, m in enumerate(members) if m.post_n is not None]
    if post:
        group.post = [members[j] for j in post]
        group.post_n = max(members[j].post_n or 0 for j in post)
        if len(post) < len(members):
            group.post_index = mx.array(post, dtype=mx.int32)
    return group


def _plan_groups(rows: Sequence[RowSampling], vocab: int) -> list[_Group]:
    by_candidates: dict[Candidates, list[int]] = {}
    for i, row in enumerate(rows):
        by_candidates.setdefault(candidates_of(row.params, vocab), []).append(i)
    return [
        _build_group(candidates, positions, [rows[i] for i in positions], len(rows), vocab)
        for candidates, positions in by_candidates.items()
    ]


def _sample_group(group: _Group, logprobs: mx.array) -> mx.array:
    """The group's tokens: the sampling chain over its rows, in one batched graph."""
    rows = logprobs if group.index is None else mx.take(logprobs, group.index, axis=0)
    if group.bias is not None:
        rows = rows + group.bias.astype(rows.dtype)
    settings = group.settings
    if settings is None:
        tokens = mx.argmax(rows, axis=-1)
        if group.post is not None:
            _keep_post(group, _PostBatch(_post_rows(group, tokens)))
        return tokens
    members = group.members
    # One member draws with its own key for every row (a request's own sampler may get
    # several rows); several draw with a key per row.
    keys = members[0].key if len(members) == 1 else mx.stack([m.key for m in members])  # type: ignore[misc]
    split = split_keys(keys)  # type: ignore[arg-type]
    if len(members) == 1:
        members[0].key = split[NEXT_KEYS]
    else:  # each row's own slice (a slice per row, not a gather of the column)
        for i, member in enumerate(members):
            member.key = split[i, NEXT_KEYS]
    draw_keys = key_part(split, DRAW_KEYS)
    kind, k = group.candidates
    if kind == "mirostat":
        mu = mx.stack([m.mu for m in members])  # type: ignore[misc]
        kept, ids = mirostat_truncate(settings, rows, mu, k)
        choice = draw(kept, draw_keys)
        tau, eta = settings.values("mirostat")
        new_mu = mirostat_update(kept, choice, mu, tau, eta)
        mx.async_eval(new_mu)
        for i, member in enumerate(members):
            member.mu = new_mu[i]
        # Mirostat 1 sorts; 2 is a threshold in vocabulary order.
        return _drawn(group, kept, ids, choice, ordered=k == 1)
    coin_keys = key_part(split, COIN_KEYS) if settings.flips_coins else None
    vals, idx = truncate(settings, group.candidates, rows, coin_keys)
    if not settings.uses("adaptive"):
        ordered = idx is not None and not settings.reorders
        return _drawn(group, vals, idx, draw(vals, draw_keys), ordered=ordered)
    zero = mx.zeros((1,), dtype=mx.float32)
    averages = mx.stack([zero if m.average is None else m.average for m in members])
    vals, probs = adaptive_reshape(settings, vals, averages)
    choice = draw(vals, draw_keys)
    average = adaptive_p_update(probs, choice, averages, settings.values("adaptive")[1])
    mx.async_eval(average)
    for i, member in enumerate(members):
        if member.average is not None:
            member.average = average[i]
    return _drawn(group, vals, idx, choice, ordered=False)


def _drawn(
    group: _Group, vals: mx.array, idx: mx.array | None, choice: mx.array, *, ordered: bool
) -> mx.array:
    """The tokens of the rows' draws `choice` among their final candidates `vals`; keeps the
    post-sampling distributions of the rows that asked."""
    tokens = chosen_tokens(choice, idx)
    if group.post is not None:
        # Only the rows that asked, in one graph: the draw's distribution, summarized.
        sub = [_post_rows(group, a) for a in (vals, choice, tokens)]
        sub_idx = None if idx is None else _post_rows(group, idx)
        chosen, top, ids = truncated_top(sub[0], sub_idx, sub[1], group.post_n, ordered=ordered)
        _keep_post(group, _PostBatch(sub[2], chosen, top, ids))
    return tokens


def _post_rows(group: _Group, a: mx.array) -> mx.array:
    return a if group.post_index is None else mx.take(a, group.post_index, axis=0)


def _keep_post(group: _Group, batch: _PostBatch) -> None:
    mx.async_eval(*batch.arrays)
    for j, member in enumerate(group.post or ()):
        member.post.append((batch, j))


class BatchSampler:
    """`sampler(logprobs[B, V]) -> tokens[B]` for a batch of rows with their own settings.

    Give the same instance to every sequence of a `DecodeBatch`; before each call it will
    make, queue that call's rows in batch order with `expect` (its `before_sampling`). A
    call whose batch size differs from the rows queued for it (or with none queued) raises
    `BatchRowsError`: an engine bug, the rows named and the rows sampled differ.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[RowSampling, ...]] = deque()
        self._rows: tuple[RowSampling, ...] = ()
        self._groups: list[_Group] = []

    def expect(self, rows: Sequence[RowSampling]) -> None:
        """Queue the rows (in batch order) of the next call not yet queued."""
        self._queue.append(tuple(rows))

    @property
    def pending(self) -> int:
        """Calls queued and not made yet."""
        return len(self._queue)

    def clear(self) -> None:
        """Forget every queued call."""
        self._queue.clear()

    def __call__(self, logprobs: mx.array) -> mx.array:
        if not self._queue:
            raise BatchRowsError("the batch sampler was called with no rows queued")
        rows = self._queue.popleft()
        if len(rows) != logprobs.shape[0]:
            raise BatchRowsError(
                f"the batch sampler expected {len(rows)} rows and got {logprobs.shape[0]}"
            )
        return self.sample(rows, logprobs)

    def sample(self, rows: Sequence[RowSampling], logprobs: mx.array) -> mx.array:
        """Sample one token per row of `logprobs` with `rows`' settings; advances their keys."""
        rows = tuple(rows)
        if len(rows) != len(self._rows) or any(
            a is not b for a, b in zip(rows, self._rows, strict=True)
        ):
            self._rows, self._groups = rows, _plan_groups(rows, logprobs.shape[-1])
        groups = self._groups
        if len(groups) == 1:
            tokens = _sample_group(groups[0], logprobs)
        else:
            parts = [_sample_group(g, logprobs).astype(mx.uint32) for g in groups]
            order = [i for g in groups for i in g.rows]
            inverse = [0] * len(order)
            for j, i in enumerate(order):
                inverse[i] = j
            tokens = mx.take(mx.concatenate(parts), mx.array(inverse, dtype=mx.int32))
        for i, row in enumerate(rows):
            row.last = (tokens, logprobs, i)
        return tokens

    @staticmethod
    def last_choice(row: RowSampling) -> tuple[mx.array, mx.array] | None:
        """The token (a lazy scalar) and log-probability row `row` last got, if any."""
        if row.last is None:
            return None
        tokens, logprobs, i = row.last
        return tokens[i], logprobs[i]
