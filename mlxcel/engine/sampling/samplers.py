"""Token samplers: top-n-sigma, top-k, typical-p, top-p, min-p, XTC, temperature (fixed or
dynamic) and p-less, then a categorical draw.

The order is llama.cpp's (top_n_sigma; top_k; typ_p; top_p; min_p; xtc; temperature), with
mlxcel's p-less last. Mirostat (1 or 2) replaces that chain, as in llama.cpp: the temperature,
then Mirostat's own truncation, whose target `mu` each draw updates (the sampler's state).
Adaptive-p, when on, replaces the plain draw at the end of the chain: it reshapes what is left
around a target probability that its running average of drawn probabilities adapts.

A sampler is a closure `sampler(logprobs[B, V]) -> token ids[B]` that stays lazy (no host
sync). When top-k is on, every later stage works on the k candidates only (a partition
instead of a full vocabulary sort); without top-k the vocabulary is sorted only when top-p
needs it.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from mlxcel.engine.sampling.params import SamplingParams

Sampler = Callable[[mx.array], mx.array]

_NEG_INF = float("-inf")
_LN2 = math.log(2.0)
MIROSTAT_M = 100  # llama.cpp's m: Mirostat 1 fits its Zipf exponent on the top 100 tokens
# llama.cpp's adaptive-p shape: logits peak at 5 for tokens at the adapted target and fall
# off with the distance to it, over a width of 0.3 in probability.
ADAPTIVE_WIDTH, ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS = 0.3, 5.0, 10.0
_MIN_TEMPERATURE = 1e-6  # a dynamic temperature of 0 (llama.cpp divides by it) draws greedily


@dataclass(frozen=True)
class _Plan:
    """The truncation stages of one request, resolved once."""

    temperature: float
    top_k: int
    top_p: float
    log_min_p: float | None
    xtc_probability: float
    xtc_threshold: float
    p_less: bool
    top_n_sigma: float | None = None
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float | None = None
    adaptive_decay: float = 0.9

    @classmethod
    def from_params(cls, params: SamplingParams) -> _Plan:
        return cls(
            temperature=float(params.temperature),
            top_k=max(int(params.top_k), 0),
            top_p=float(params.top_p),
            log_min_p=math.log(params.min_p) if params.min_p > 0 else None,
            xtc_probability=float(params.xtc_probability),
            xtc_threshold=float(params.xtc_threshold),
            p_less=bool(params.p_less),
            top_n_sigma=float(params.top_n_sigma) if params.top_n_sigma > 0 else None,
            typical_p=float(params.typical_p),
            dynatemp_range=float(params.dynatemp_range),
            dynatemp_exponent=float(params.dynatemp_exponent),
            mirostat=int(params.mirostat),
            mirostat_tau=float(params.mirostat_tau),
            mirostat_eta=float(params.mirostat_eta),
            adaptive_target=(
                None
                if params.adaptive_target < 0 or params.mirostat
                else min(float(params.adaptive_target), 1.0)
            ),
            adaptive_decay=min(max(float(params.adaptive_decay), 0.0), 0.99),
        )

    @property
    def initial_mu(self) -> float:
        """Mirostat's starting target: twice tau, as llama.cpp starts it."""
        return 2.0 * self.mirostat_tau


def greedy(logprobs: mx.array) -> mx.array:
    """The most probable token of each row."""
    return mx.argmax(logprobs, axis=-1)


def top_k_candidates(logprobs: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The `k` most probable tokens of each row, most probable first: (values, token ids)."""
    idx = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logprobs, idx, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(vals, order, axis=-1), mx.take_along_axis(idx, order, axis=-1)


def sorted_candidates(logprobs: mx.array) -> tuple[mx.array, mx.array]:
    """All tokens, most probable first: (values, token ids)."""
    idx = mx.argsort(-logprobs, axis=-1)
    return mx.take_along_axis(logprobs, idx, axis=-1), idx


def mask_top_n_sigma(vals: mx.array, n: float | mx.array) -> mx.array:
    """Keep tokens whose logit is at least max - n * std, the mean and standard deviation
    taken over the finite logits of the row (llama.cpp's top-n-sigma; shift-invariant, so
    log-probabilities give the same set as logits)."""
    finite = vals > _NEG_INF
    count = mx.maximum(mx.sum(finite, axis=-1, keepdims=True), 1)
    mean = mx.sum(mx.where(finite, vals, 0.0), axis=-1, keepdims=True) / count
    centred = mx.where(finite, vals - mean, 0.0)
    std = mx.sqrt(mx.sum(centred * centred, axis=-1, keepdims=True) / count)
    threshold = mx.max(vals, axis=-1, keepdims=True) - n * std
    return mx.where(vals >= threshold, vals, _NEG_INF)


def _entropy(vals: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(log-probabilities, probabilities, entropy [B, 1]) of `softmax(vals)` per row."""
    logp = vals - mx.logsumexp(vals, axis=-1, keepdims=True)
    probs = mx.exp(logp)
    entropy = -mx.sum(mx.where(probs > 0, probs * logp, 0.0), axis=-1, keepdims=True)
    return logp, probs, entropy


def mask_typical(vals: mx.array, typical_p: float | mx.array) -> mx.array:
    """Locally typical sampling: keep the tokens whose surprise -log p is closest to the
    entropy, fewest first, until their mass exceeds `typical_p` (llama.cpp's typ_p: the
    token that crosses it is kept)."""
    logp, probs, entropy = _entropy(vals)
    finite = vals > _NEG_INF
    shifted = mx.where(finite, mx.abs(-logp - entropy), math.inf)
    order = mx.argsort(shifted, axis=-1)
    mass_before = mx.cumsum(mx.take_along_axis(probs, order, axis=-1), axis=-1, inclusive=False)
    keep_sorted = mass_before <= typical_p
    keep = mx.put_along_axis(mx.zeros(vals.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep & finite, vals, _NEG_INF)


def dynamic_temperature(
    vals: mx.array,
    temperature: float | mx.array,
    dynatemp_range: float | mx.array,
    exponent: float | mx.array,
) -> mx.array:
    """llama.cpp's dynamic temperature [B, 1]: from temperature - range (at least 0) for a
    certain row to temperature + range for a uniform one, by the row's entropy over its
    finite candidates relative to the most it could be, raised to `exponent`."""
    _, _, entropy = _entropy(vals)
    count = mx.sum(vals > _NEG_INF, axis=-1, keepdims=True)
    most = mx.log(mx.maximum(count, 2).astype(mx.float32))
    normalized = mx.where(count > 1, entropy / most, 0.0)
    low = mx.maximum(temperature - dynatemp_range, 0.0)
    high = temperature + dynatemp_range
    # A certain row at range >= temperature gets 0: the draw is then the top token.
    return mx.maximum(low + (high - low) * mx.power(normalized, exponent), _MIN_TEMPERATURE)


def mirostat_mask(vals: mx.array, mu: mx.array, version: int) -> mx.array:
    """Mirostat's truncation of one step (llama.cpp's mirostat / mirostat_v2 samplers).

    `vals` are the temperature-scaled values, `mu` ([B, 1]) each row's current target.
    Version 2 keeps the tokens whose surprise -log2 p is at most mu (a threshold: `vals` may
    be in any order). Version 1 needs `vals` most probable first: it keeps the top k, k
    estimated from the Zipf exponent of the `MIROSTAT_M` most probable tokens and mu over the
    row's whole width (the vocabulary). The most probable token always stays.
    """
    width = vals.shape[-1]
    logp = vals - mx.logsumexp(vals, axis=-1, keepdims=True)
    if version == 2:
        top = vals >= mx.max(vals, axis=-1, keepdims=True)
        return mx.where((-logp / _LN2 <= mu) | top, vals, _NEG_INF)
    m = min(MIROSTAT_M, width)
    head = logp[:, :m]
    b = head[:, :-1] - head[:, 1:]
    i = mx.arange(m - 1).astype(mx.float32)
    t = mx.log((i + 2.0) / (i + 1.0))
    used = mx.isfinite(b)  # a token a grammar removed has no probability to compare
    sum_tb = mx.sum(mx.where(used, t * b, 0.0), axis=-1, keepdims=True)
    sum_tt = mx.sum(mx.where(used, t * t, 0.0), axis=-1, keepdims=True)
    s_hat = sum_tb / sum_tt
    epsilon = s_hat - 1.0
    k = mx.power(
        epsilon * mx.power(2.0, mu) / (1.0 - mx.power(float(width), -epsilon)), 1.0 / s_hat
    )
    k = mx.where(mx.isfinite(k), k, float(width))
    keep = mx.arange(width) < mx.maximum(mx.floor(k), 1.0)
    return mx.where(keep, vals, _NEG_INF)


def mirostat_candidates(
    vals: mx.array, mu: mx.array, version: int
) -> tuple[mx.array, mx.array | None]:
    """Mirostat's candidates of one step from the temperature-scaled vocabulary `vals`:
    (values after the truncation, removed ones -inf; their token ids). Mirostat 1's are
    sorted, most probable first; Mirostat 2's stay in vocabulary order (ids None: a
    threshold needs no sort)."""
    if version == 2:
        return mirostat_mask(vals, mu, 2), None
    vals, idx = sorted_candidates(vals)
    return mirostat_mask(vals, mu, 1), idx


def mirostat_update(
    masked: mx.array, choice: mx.array, mu: mx.array, tau: float | mx.array, eta: float | mx.array
) -> mx.array:
    """The next mu ([B, 1]): mu - eta * (surprise of the drawn candidate - tau), the surprise
    -log2 p under the truncated, renormalized distribution it was drawn from."""
    logp = masked - mx.logsumexp(masked, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, choice[:, None], axis=-1)
    return mu - eta * (-chosen / _LN2 - tau)


def adaptive_p_transform(
    vals: mx.array, target: float | mx.array, average: mx.array
) -> tuple[mx.array, mx.array]:
    """llama.cpp's adaptive-p reshaping: (new values, the probabilities before it).

    The adapted target is 2 * target - `average` (the running average of drawn tokens'
    probabilities, [B, 1]), clamped to [0, 1]; each finite candidate's new logit falls from
    `ADAPTIVE_PEAK` with its distance d to it (in units of `ADAPTIVE_WIDTH`): quadratic near
    the target, linear far from it (peak - sharpness * d^2 / (1 + d)).
    """
    probs = mx.exp(vals - mx.logsumexp(vals, axis=-1, keepdims=True))
    adapted = mx.clip(2.0 * target - average, 0.0, 1.0)
    distance = mx.abs(probs - adapted) * (1.0 / ADAPTIVE_WIDTH)
    shaped = ADAPTIVE_PEAK - ADAPTIVE_SHARPNESS * distance * distance / (1.0 + distance)
    return mx.where(vals > _NEG_INF, shaped, _NEG_INF), probs


def adaptive_p_update(
    probs: mx.array, choice: mx.array, average: mx.array, decay: float | mx.array
) -> mx.array:
    """The next running average ([B, 1]): the drawn candidate's probability before the
    reshaping, weighted 1 - decay (llama.cpp's weighted sum over its total weight)."""
    chosen = mx.take_along_axis(probs, choice[:, None], axis=-1)
    return (1.0 - decay) * chosen + decay * average


def mask_top_p(sorted_vals: mx.array, top_p: float) -> mx.array:
    """Keep the shortest most-probable prefix whose probability mass reaches `top_p`.

    `sorted_vals` must be in decreasing order; probabilities are renormalized over the
    candidates that are still finite.
    """
    probs = mx.softmax(sorted_vals, axis=-1)
    mass_before = mx.cumsum(probs, axis=-1, inclusive=False)
    return mx.where(mass_before < top_p, sorted_vals, _NEG_INF)


def mask_min_p(vals: mx.array, log_min_p: float) -> mx.array:
    """Keep tokens with p >= min_p * p_max (in log space: v >= v_max + log(min_p))."""
    threshold = mx.max(vals, axis=-1, keepdims=True) + log_min_p
    return mx.where(vals >= threshold, vals, _NEG_INF)


def mask_xtc(vals: mx.array, threshold: float, apply: mx.array | None = None) -> mx.array:
    """Exclude Top Choices: drop every token with p >= `threshold` but the least probable.

    Only when at least two tokens reach the threshold (ties with the least probable one are
    kept). `apply` ([B, 1] booleans) selects the rows it applies to; None: all rows.
    """
    probs = mx.softmax(vals, axis=-1)
    above = probs >= threshold
    least = mx.min(mx.where(above, probs, math.inf), axis=-1, keepdims=True)
    enough = mx.sum(above, axis=-1, keepdims=True) >= 2
    drop = above & (probs > least) & enough
    if apply is not None:
        drop = drop & apply
    return mx.where(drop, _NEG_INF, vals)


def mask_p_less(vals: mx.array) -> mx.array:
    """Keep tokens with p >= sum(p^2) (the distribution's own collision probability).

    The most probable token always satisfies it; it is kept explicitly against rounding.
    """
    probs = mx.softmax(vals, axis=-1)
    threshold = mx.sum(probs * probs, axis=-1, keepdims=True)
    keep = (probs >= threshold) | (vals >= mx.max(vals, axis=-1, keepdims=True))
    return mx.where(keep, vals, _NEG_INF)


def _truncate(
    plan: _Plan, logprobs: mx.array, xtc_key: mx.array | None
) -> tuple[mx.array, mx.array | None]:
    """Candidates after every stage, divided by the temperature: (logits, token ids).

    Token ids are None when the candidates are the whole vocabulary in its own order.
    """
    vocab = logprobs.shape[-1]
    vals = logprobs.astype(mx.float32)
    if plan.top_n_sigma is not None:
        vals = mask_top_n_sigma(vals, plan.top_n_sigma)
    idx: mx.array | None = None
    if 0 < plan.top_k < vocab:
        vals, idx = top_k_candidates(vals, plan.top_k)
    elif plan.top_p < 1.0:
        vals, idx = sorted_candidates(vals)
    if plan.typical_p < 1.0:
        vals = mask_typical(vals, plan.typical_p)
    if plan.top_p < 1.0:
        vals = mask_top_p(vals, plan.top_p)
    if plan.log_min_p is not None:
        vals = mask_min_p(vals, plan.log_min_p)
    if plan.xtc_probability > 0:
        apply = None
        if plan.xtc_probability < 1:
            draw = mx.random.uniform(shape=(vals.shape[0], 1), key=xtc_key)
            apply = draw < plan.xtc_probability
        vals = mask_xtc(vals, plan.xtc_threshold, apply)
    if plan.dynatemp_range > 0:
        # float32 scalars: the arithmetic then matches the batched sampler's columns
        temperature = dynamic_temperature(
            vals,
            mx.array(plan.temperature, dtype=mx.float32),
            mx.array(plan.dynatemp_range, dtype=mx.float32),
            mx.array(plan.dynatemp_exponent, dtype=mx.float32),
        )
        vals = vals * (1.0 / temperature)
    else:
        vals = vals * (1.0 / plan.temperature)
    if plan.p_less:
        vals = mask_p_less(vals)
    return vals, idx


def gumbel_choice(vals: mx.array, key: mx.array) -> mx.array:
    """Index of a draw from each row's `softmax(vals)` (Gumbel-max with noise from `key`).

    The noise depends only on `key` and the row width, so a one-row call and row `i` of a
    batched call with key `i` draw alike (`mlxcel.engine.sampling.batched` relies on it).
    """
    return mx.argmax(vals + mx.random.gumbel(shape=vals.shape, key=key), axis=-1)


def chosen_tokens(choice: mx.array, idx: mx.array | None) -> mx.array:
    """Token ids of each row's drawn candidate position `choice` ([B]) among candidates
    `idx` ([B, width] token ids; None: the whole vocabulary in its own order)."""
    return choice if idx is None else mx.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]


def _initial_key(seed: int | None) -> mx.array:
    if seed is None or seed < 0:
        seed = secrets.randbits(63)
    return mx.random.key(seed & 0xFFFF_FFFF_FFFF_FFFF)


def make_sampler(params: SamplingParams) -> Sampler:
    """The request's token sampler: greedy when temperature <= 0, else the truncation chain.

    Randomness comes from a per-request key (from `params.seed`, or a fresh random one) split
    at every call, so the same seed, parameters and logits give the same tokens regardless
    of the global MLX random state.
    """
    if params.temperature <= 0:
        return greedy
    plan = _Plan.from_params(params)
    if plan.mirostat:
        return _mirostat_sampler(plan, params.seed)
    if plan.adaptive_target is not None:
        return _adaptive_sampler(plan, params.seed)
    key = [_initial_key(params.seed)]

    def sampler(logprobs: mx.array) -> mx.array:
        keys = mx.random.split(key[0], 3)
        key[0] = keys[0]
        vals, idx = _truncate(plan, logprobs, keys[1])
        return chosen_tokens(gumbel_choice(vals, keys[2]), idx)

    return sampler


def _mirostat_candidates(
    plan: _Plan, logprobs: mx.array, mu: mx.array
) -> tuple[mx.array, mx.array | None]:
    """`mirostat_candidates` of one request's log-probabilities after its temperature."""
    vals = logprobs.astype(mx.float32) * (1.0 / plan.temperature)
    return mirostat_candidates(vals, mu, plan.mirostat)


def _adaptive_sampler(plan: _Plan, seed: int | None) -> Sampler:
    """One request's chain ending in adaptive-p; its `draw_states` holds (token, running
    average) of the last draws, for `post_sampling_of`."""
    key = [_initial_key(seed)]
    # float32 arrays, not Python floats: the arithmetic then matches the batched sampler's
    target = mx.array([[plan.adaptive_target or 0.0]], dtype=mx.float32)
    decay = mx.array([[plan.adaptive_decay]], dtype=mx.float32)
    average = [target]  # primed as if on target, as llama.cpp starts it
    used: deque[tuple[mx.array, mx.array]] = deque(maxlen=4)

    def sampler(logprobs: mx.array) -> mx.array:
        keys = mx.random.split(key[0], 3)
        key[0] = keys[0]
        vals, idx = _truncate(plan, logprobs, keys[1])
        vals, probs = adaptive_p_transform(vals, target, average[0])
        choice = gumbel_choice(vals, keys[2])
        tokens = chosen_tokens(choice, idx)
        used.append((tokens, average[0]))
        average[0] = adaptive_p_update(probs, choice, average[0], decay)
        mx.async_eval(average[0])
        return tokens

    sampler.draw_states = used  # type: ignore[attr-defined]
    return sampler


def _mirostat_sampler(plan: _Plan, seed: int | None) -> Sampler:
    """One request's Mirostat sampler; its `draw_states` holds (token, mu) of the last
    draws, for `post_sampling_of`."""
    key = [_initial_key(seed)]
    mu = [mx.array([[plan.initial_mu]], dtype=mx.float32)]
    used: deque[tuple[mx.array, mx.array]] = deque(maxlen=4)

    def sampler(logprobs: mx.array) -> mx.array:
        keys = mx.random.split(key[0], 3)
        key[0] = keys[0]
        vals, idx = _mirostat_candidates(plan, logprobs, mu[0])
        choice = gumbel_choice(vals, keys[2])
        tokens = chosen_tokens(choice, idx)
        used.append((tokens, mu[0]))
        mu[0] = mirostat_update(vals, choice, mu[0], plan.mirostat_tau, plan.mirostat_eta)
        mx.async_eval(mu[0])  # else each step's mu keeps the previous step's graph alive
        return tokens

    sampler.draw_states = used  # type: ignore[attr-defined]
    return sampler


def _draw_state(sampler: Sampler | None, token: int, initial: float) -> mx.array:
    """The state (Mirostat's mu, adaptive-p's running average) `sampler` drew `token` with:
    its oldest recorded draw of that token (earlier ones are dropped), or `initial` when it
    kept no such draw."""
    used = getattr(sampler, "draw_states", None)
    while used:
        tokens, state = used.popleft()
        if int(tokens[0].item()) == token:
            return state
    return mx.array([[initial]], dtype=mx.float32)


def make_distribution(params: SamplingParams) -> Callable[..., mx.array]:
    """`distribution(logprobs, key=None) -> logprobs[B, V]` the sampler would draw from.

    Removed tokens are -inf; the rest are renormalized after the temperature. Greedy puts
    all the mass on the argmax. `key` only matters for XTC with 0 < probability < 1.
    Mirostat's and adaptive-p's are the first draw's (their state at its initial value).
    """
    plan = _Plan.from_params(params)

    def distribution(logprobs: mx.array, key: mx.array | None = None) -> mx.array:
        rows, vocab = logprobs.shape
        if plan.temperature <= 0:
            best = mx.argmax(logprobs, axis=-1, keepdims=True)
            hot = mx.arange(vocab)[None, :] == best
            return mx.where(hot, 0.0, _NEG_INF)
        idx: mx.array | None
        if plan.mirostat:
            mu = mx.full((rows, 1), plan.initial_mu, dtype=mx.float32)
            vals, idx = _mirostat_candidates(plan, logprobs, mu)
        else:
            vals, idx = _truncate(plan, logprobs, key)
            if plan.adaptive_target is not None:
                start = mx.full((rows, 1), plan.adaptive_target, dtype=mx.float32)
                vals, _ = adaptive_p_transform(vals, plan.adaptive_target, start)
        if idx is not None:
            full = mx.full((rows, vocab), _NEG_INF, dtype=vals.dtype)
            vals = mx.put_along_axis(full, idx, vals, axis=-1)
        return vals - mx.logsumexp(vals, axis=-1, keepdims=True)

    return distribution


PostSampling = tuple[float, tuple[tuple[int, float], ...]]
"""What the sampler drew from, for one token: (the token's log-probability, the most
probable candidates as (token id, log-probability), most probable first), both under the
distribution after every truncation stage and the temperature (llama-server's
`post_sampling_probs`). Only candidates the draw could pick are listed (no -inf)."""


def truncated_top(
    vals: mx.array, idx: mx.array | None, choice: mx.array, n: int, *, ordered: bool
) -> tuple[mx.array, mx.array, mx.array]:
    """The draw's distribution summarized: (log-probability of the chosen candidate [B],
    log-probabilities [B, n'] and token ids [B, n'] of the `n'` = min(n, width) most probable
    candidates, most probable first).

    `vals` are a batch's candidates after every stage ([B, width], removed ones -inf), `idx`
    their token ids (None: the whole vocabulary in its own order) and `choice` the drawn
    candidate's position. `ordered`: `vals` already run most probable first (top-k or a
    sorted vocabulary, no XTC), so the top is a slice.
    """
    logp = vals - mx.logsumexp(vals, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logp, choice[:, None], axis=-1)[:, 0]
    k = max(1, min(n, logp.shape[-1]))
    if ordered:
        top = logp[:, :k]
        pos = idx[:, :k] if idx is not None else mx.broadcast_to(mx.arange(k), top.shape)
        return chosen, top, pos
    part = mx.argpartition(-logp, kth=k - 1, axis=-1)[:, :k]
    part_vals = mx.take_along_axis(logp, part, axis=-1)
    order = mx.argsort(-part_vals, axis=-1)
    top = mx.take_along_axis(part_vals, order, axis=-1)
    pos = mx.take_along_axis(part, order, axis=-1)
    if idx is not None:
        pos = mx.take_along_axis(idx, pos, axis=-1)
    return chosen, top, pos


def host_post_sampling(chosen: float, ids: list[int], logps: list[float], n: int) -> PostSampling:
    """A `PostSampling` from host values: the first `n` finite candidates."""
    top = tuple((i, lp) for i, lp in zip(ids, logps, strict=True) if lp != _NEG_INF)
    return chosen, top[:n]


def greedy_post_sampling(token: int, n: int) -> PostSampling:
    """A greedy draw's distribution: all the mass on the chosen token."""
    return 0.0, ((token, 0.0),)[:n]


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
    `make_sampler` closure).

    XTC with 0 < probability < 1 flips a coin per draw that is not known here: this takes a
    fresh coin, and the distribution without XTC when that one excludes `token` (which the
    draw itself then cannot have applied).
    """
    plan = _Plan.from_params(params)
    if plan.temperature <= 0 or (plan.top_k == 1 and not plan.mirostat):
        return greedy_post_sampling(token, n)
    row = logprobs.reshape(1, -1)
    if plan.mirostat:
        mu = _draw_state(sampler, token, plan.initial_mu)
        kept, ids = _mirostat_candidates(plan, row, mu)
        position = mx.array([token]) if ids is None else mx.argmax(ids == token, axis=-1)
        drawn, best, best_ids = truncated_top(kept, ids, position, n, ordered=ids is not None)
        value = float(drawn.item())  # type: ignore[arg-type]
        return host_post_sampling(value, best_ids[0].tolist(), best[0].tolist(), n)  # type: ignore[arg-type]
    choice = mx.array([token])
    average = None
    if plan.adaptive_target is not None:
        average = _draw_state(sampler, token, plan.adaptive_target)
    for attempt in (plan, replace(plan, xtc_probability=0.0)):
        vals, idx = _truncate(attempt, row, None)
        if attempt.adaptive_target is not None and average is not None:
            vals, _ = adaptive_p_transform(vals, attempt.adaptive_target, average)
        if idx is not None:
            full = mx.full(row.shape, _NEG_INF, dtype=vals.dtype)
            vals = mx.put_along_axis(full, idx, vals, axis=-1)
        chosen, top, pos = truncated_top(vals, None, choice, n, ordered=False)
        value = float(chosen.item())  # type: ignore[arg-type]
        if value != _NEG_INF or attempt.xtc_probability == 0:
            break
    return host_post_sampling(value, pos[0].tolist(), top[0].tolist(), n)  # type: ignore[arg-type]
