"""One sampler for a whole decode batch: every row's settings as arrays in one graph.

mlx-lm's `BatchGenerator` samples a batch in one call only when every row holds the same
sampler object; otherwise it calls each row's sampler on its own one-row slice (one small
graph per request per step). `BatchSampler` is that one shared object: before each call
the engine queues the rows the call will see (`expect`), and the sampler applies each row's
temperature (fixed or dynamic), top-n-sigma, top-k, typical-p, top-p, min-p, XTC, p-less,
Mirostat target, adaptive-p average and random key as per-row arrays.

Rows are grouped by how their candidates are found (greedy; the top k for one k; the whole
vocabulary sorted; the whole vocabulary in its own order), and each group is one batched
graph. Inside a group each row's draw uses its own key, split exactly as `make_sampler`'s
closure splits it, over the same candidates: a row samples the same tokens here as its own
closure would, whatever rows share the batch (so a seeded request stays reproducible and
greedy rows stay the argmax of their own row).

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
from mlxcel.engine.sampling.samplers import (
    PostSampling,
    _initial_key,
    _Plan,
    adaptive_p_transform,
    adaptive_p_update,
    chosen_tokens,
    dynamic_temperature,
    greedy_post_sampling,
    gumbel_choice,
    host_post_sampling,
    mask_min_p,
    mask_p_less,
    mask_top_n_sigma,
    mask_top_p,
    mask_typical,
    mask_xtc,
    mirostat_candidates,
    mirostat_update,
    sorted_candidates,
    top_k_candidates,
    truncated_top,
)

_NEG_INF = float("-inf")

_split3 = mx.vmap(lambda key: mx.random.split(key, 3))
_uniform1 = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))
_choice = mx.vmap(gumbel_choice)


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
    """One request's sampling state inside a `BatchSampler` (its plan and random key)."""

    __slots__ = (
        "average",
        "bias",
        "greedy",
        "group",
        "key",
        "last",
        "mu",
        "params",
        "plan",
        "post",
        "post_n",
    )

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        *,
        logit_bias: bool = False,
        post_probs: int | None = None,
    ) -> None:
        """`logit_bias`: apply `params.logit_bias` here (ValueError for an id outside the
        vocabulary); False: it is left to a logits processor. `post_probs`: keep, for every
        draw, the drawn token's probability and the `post_probs` most probable candidates
        of the distribution it was drawn from (`take_post`); None: not kept."""
        self.post_n = post_probs
        # At most two draws are outstanding: the one being reported and the one ahead of it.
        self.post: deque[tuple[_PostBatch, int]] = deque(maxlen=4)
        self.params = params
        self.bias = merge_logit_bias(params.logit_bias, vocab_size) if logit_bias else {}
        self.greedy = params.temperature <= 0
        self.plan = _Plan.from_params(params)
        self.key: mx.array | None = None if self.greedy else _initial_key(params.seed)
        self.last: tuple[mx.array, mx.array, int] | None = None  # (tokens, logprobs, row)
        plan = self.plan
        self.mu: mx.array | None = None  # Mirostat's target, [1]
        self.average: mx.array | None = None  # adaptive-p's running average, [1]
        if plan.adaptive_target is not None:
            self.average = mx.array([plan.adaptive_target], dtype=mx.float32)
        if self.greedy:
            self.group: tuple[str, int] = ("greedy", 0)
        elif plan.mirostat:
            self.group = ("mirostat", plan.mirostat)
            self.mu = mx.array([plan.initial_mu], dtype=mx.float32)
        elif 0 < plan.top_k < vocab_size:
            self.group = ("top_k", plan.top_k)
        elif plan.top_p < 1.0:
            self.group = ("sorted", 0)
        else:
            self.group = ("vocab", 0)

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
    """Rows that find their candidates the same way, with their settings as arrays."""

    kind: str
    k: int
    rows: list[int]  # positions in the batch
    members: list[RowSampling]
    index: mx.array | None  # `rows` as an array; None when the group is the whole batch
    bias: mx.array | None = None  # [G, V] logit bias, when a member has one
    inv_temperature: mx.array | None = None
    top_p: mx.array | None = None
    uses_top_p: mx.array | None = None
    log_min_p: mx.array | None = None
    xtc_probability: mx.array | None = None
    xtc_threshold: mx.array | None = None
    xtc_always: bool = False
    p_less: mx.array | None = None
    top_n_sigma: mx.array | None = None  # n per row ([G, 1]); off rows keep every token
    uses_top_n_sigma: mx.array | None = None
    typical_p: mx.array | None = None
    uses_typical: mx.array | None = None
    temperature: mx.array | None = None  # with the dynamic-temperature columns below
    dynatemp_range: mx.array | None = None
    dynatemp_exponent: mx.array | None = None
    uses_dynatemp: mx.array | None = None
    mirostat_tau: mx.array | None = None
    mirostat_eta: mx.array | None = None
    adaptive_target: mx.array | None = None  # with the two columns below
    adaptive_decay: mx.array | None = None
    uses_adaptive: mx.array | None = None
    post: list[RowSampling] | None = None  # members keeping post-sampling distributions
    post_index: mx.array | None = None  # their positions in the group; None: all of it
    post_n: int = 0


def _column(values: Sequence[float | bool]) -> mx.array:
    return mx.array(list(values))[:, None]


def _dense_bias(members: list[RowSampling], vocab: int) -> mx.array:
    dense = np.zeros((len(members), vocab), dtype=np.float32)
    for i, member in enumerate(members):
        if member.bias:
            dense[i, list(member.bias)] = list(member.bias.values())
    return mx.array(dense)


def _build_group(
    kind: str, k: int, rows: list[int], members: list[RowSampling], n: int, vocab: int
) -> _Group:
    index = None if len(rows) == n else mx.array(rows, dtype=mx.int32)
    group = _Group(kind, k, rows, members, index)
    if any(m.bias for m in members):
        group.bias = _dense_bias(members, vocab)
    post = [j for j, m in enumerate(members) if m.post_n is not None]
    if post:
        group.post = [members[j] for j in post]
        group.post_n = max(members[j].post_n or 0 for j in post)
        if len(post) < len(members):
            group.post_index = mx.array(post, dtype=mx.int32)
    if kind == "greedy":
        return group
    plans = [m.plan for m in members]
    group.inv_temperature = _column([1.0 / p.temperature for p in plans])
    if kind == "mirostat":
        group.mirostat_tau = _column([p.mirostat_tau for p in plans])
        group.mirostat_eta = _column([p.mirostat_eta for p in plans])
        return group
    if any(p.top_p < 1.0 for p in plans):
        group.top_p = _column([p.top_p for p in plans])
        group.uses_top_p = _column([p.top_p < 1.0 for p in plans])
    if any(p.log_min_p is not None for p in plans):
        group.log_min_p = _column([_NEG_INF if p.log_min_p is None else p.log_min_p for p in plans])
    if any(p.xtc_probability > 0 for p in plans):
        group.xtc_probability = _column([p.xtc_probability for p in plans])
        group.xtc_threshold = _column([p.xtc_threshold for p in plans])
        group.xtc_always = all(p.xtc_probability >= 1 for p in plans)
    if any(p.p_less for p in plans):
        group.p_less = _column([p.p_less for p in plans])
    if any(p.top_n_sigma is not None for p in plans):
        group.top_n_sigma = _column([p.top_n_sigma or 0.0 for p in plans])
        group.uses_top_n_sigma = _column([p.top_n_sigma is not None for p in plans])
    if any(p.typical_p < 1.0 for p in plans):
        group.typical_p = _column([p.typical_p for p in plans])
        group.uses_typical = _column([p.typical_p < 1.0 for p in plans])
    if any(p.dynatemp_range > 0 for p in plans):
        group.temperature = _column([p.temperature for p in plans])
        group.dynatemp_range = _column([p.dynatemp_range for p in plans])
        group.dynatemp_exponent = _column([p.dynatemp_exponent for p in plans])
        group.uses_dynatemp = _column([p.dynatemp_range > 0 for p in plans])
    if any(p.adaptive_target is not None for p in plans):
        group.adaptive_target = _column([p.adaptive_target or 0.0 for p in plans])
        group.adaptive_decay = _column([p.adaptive_decay for p in plans])
        group.uses_adaptive = _column([p.adaptive_target is not None for p in plans])
    return group


def _plan_groups(rows: Sequence[RowSampling], vocab: int) -> list[_Group]:
    by_kind: dict[tuple[str, int], list[int]] = {}
    for i, row in enumerate(rows):
        by_kind.setdefault(row.group, []).append(i)
    return [
        _build_group(kind, k, positions, [rows[i] for i in positions], len(rows), vocab)
        for (kind, k), positions in by_kind.items()
    ]


def _sample_group(group: _Group, logprobs: mx.array) -> mx.array:
    """The group's tokens: one batched graph over its rows (as `make_sampler` per row)."""
    rows = logprobs if group.index is None else mx.take(logprobs, group.index, axis=0)
    if group.bias is not None:
        rows = rows + group.bias.astype(rows.dtype)
    if group.kind == "greedy":
        tokens = mx.argmax(rows, axis=-1)
        if group.post is not None:
            _keep_post(group, _PostBatch(_post_rows(group, tokens)))
        return tokens
    keys = mx.stack([m.key for m in group.members])  # type: ignore[misc]
    split = _split3(keys)
    for i, member in enumerate(group.members):
        member.key = split[i, 0]
    vals = rows.astype(mx.float32)
    if group.kind == "mirostat":  # the temperature, then each row's truncation at its mu
        mu = mx.stack([m.mu for m in group.members])  # type: ignore[misc]
        kept, ids = mirostat_candidates(vals * group.inv_temperature, mu, group.k)  # type: ignore[operator]
        # Mirostat 1 sorts; 2 is a threshold in vocabulary order.
        return _drawn(group, kept, ids, split[:, 2], ordered=group.k == 1, state=mu)
    if group.top_n_sigma is not None:
        masked = mask_top_n_sigma(vals, group.top_n_sigma)
        vals = mx.where(group.uses_top_n_sigma, masked, vals)  # type: ignore[arg-type]
    idx: mx.array | None = None
    if group.kind == "top_k":
        vals, idx = top_k_candidates(vals, group.k)
    elif group.kind == "sorted":
        vals, idx = sorted_candidates(vals)
    if group.typical_p is not None:
        vals = mx.where(group.uses_typical, mask_typical(vals, group.typical_p), vals)  # type: ignore[arg-type]
    if group.top_p is not None:
        vals = mx.where(group.uses_top_p, mask_top_p(vals, group.top_p), vals)  # type: ignore[arg-type]
    if group.log_min_p is not None:
        vals = mask_min_p(vals, group.log_min_p)  # type: ignore[arg-type]
    if group.xtc_probability is not None:
        apply = None
        if not group.xtc_always:
            apply = _uniform1(split[:, 1]) < group.xtc_probability
        vals = mask_xtc(vals, group.xtc_threshold, apply)  # type: ignore[arg-type]
    if group.dynatemp_range is not None:
        dynamic = dynamic_temperature(
            vals,
            group.temperature,  # type: ignore[arg-type]
            group.dynatemp_range,
            group.dynatemp_exponent,  # type: ignore[arg-type]
        )
        vals = vals * mx.where(group.uses_dynatemp, 1.0 / dynamic, group.inv_temperature)  # type: ignore[arg-type]
    else:
        vals = vals * group.inv_temperature  # type: ignore[operator]
    if group.p_less is not None:
        vals = mx.where(group.p_less, mask_p_less(vals), vals)
    probs = averages = None
    if group.adaptive_target is not None:
        averages = _averages(group)
        shaped, probs = adaptive_p_transform(vals, group.adaptive_target, averages)
        vals = mx.where(group.uses_adaptive, shaped, vals)  # type: ignore[arg-type]
    ordered = (
        idx is not None
        and group.xtc_probability is None
        and group.typical_p is None
        and group.adaptive_target is None
    )
    return _drawn(group, vals, idx, split[:, 2], ordered=ordered, probs=probs, state=averages)


def _averages(group: _Group) -> mx.array:
    """The members' adaptive-p averages ([G, 1]; 0 for members without adaptive-p)."""
    zero = mx.zeros((1,), dtype=mx.float32)
    return mx.stack([zero if m.average is None else m.average for m in group.members])


def _drawn(
    group: _Group,
    vals: mx.array,
    idx: mx.array | None,
    keys: mx.array,
    *,
    ordered: bool,
    probs: mx.array | None = None,
    state: mx.array | None = None,
) -> mx.array:
    """Draw each row's token from its final candidates `vals`; keep what follows a draw: the
    rows' next state from this step's `state` ([G, 1]: Mirostat's mu, or adaptive-p's
    averages with `probs`, the candidates' probabilities before its reshaping) and the
    post-sampling distributions."""
    choice = _choice(vals, keys)
    tokens = chosen_tokens(choice, idx)
    if group.kind == "mirostat" and state is not None:
        new_mu = mirostat_update(vals, choice, state, group.mirostat_tau, group.mirostat_eta)  # type: ignore[arg-type]
        mx.async_eval(new_mu)
        for i, member in enumerate(group.members):
            member.mu = new_mu[i]
    elif probs is not None and state is not None:
        average = adaptive_p_update(probs, choice, state, group.adaptive_decay)  # type: ignore[arg-type]
        mx.async_eval(average)
        for i, member in enumerate(group.members):
            if member.average is not None:
                member.average = average[i]
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

    Give the same instance to every sequence of a `BatchGenerator`; before each call the
    generator will make, queue that call's rows in batch order with `expect`. A call whose
    batch size differs from the rows queued for it (or with none queued) raises
    `BatchRowsError`: the engine's view of the batch moved from the generator's.
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
