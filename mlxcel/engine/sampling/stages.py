"""The sampling stages' math, each on a batch of rows: top-n-sigma, the candidates (top-k or a
sorted vocabulary), typical-p, top-p, min-p, XTC, the temperature (fixed or dynamic), p-less,
Mirostat, adaptive-p, the categorical draw and the post-sampling summary.

Each function works on `[B, width]` values and takes its settings as scalars or `[B, 1]`
columns, and stays lazy (no host sync). The order they run in is `truncation.truncate`'s.
"""

from __future__ import annotations

import math

import mlx.core as mx

_NEG_INF = float("-inf")
_LN2 = math.log(2.0)
MIROSTAT_M = 100  # llama.cpp's m: Mirostat 1 fits its Zipf exponent on the top 100 tokens
# llama.cpp's adaptive-p shape: logits peak at 5 for tokens at the adapted target and fall
# off with the distance to it, over a width of 0.3 in probability.
ADAPTIVE_WIDTH, ADAPTIVE_PEAK, ADAPTIVE_SHARPNESS = 0.3, 5.0, 10.0
_MIN_TEMPERATURE = 1e-6  # a dynamic temperature of 0 (llama.cpp divides by it) draws greedily


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


def mask_top_p(sorted_vals: mx.array, top_p: float | mx.array) -> mx.array:
    """Keep the shortest most-probable prefix whose probability mass reaches `top_p`.

    `sorted_vals` must be in decreasing order; probabilities are renormalized over the
    candidates that are still finite.
    """
    probs = mx.softmax(sorted_vals, axis=-1)
    mass_before = mx.cumsum(probs, axis=-1, inclusive=False)
    return mx.where(mass_before < top_p, sorted_vals, _NEG_INF)


def mask_min_p(vals: mx.array, log_min_p: float | mx.array) -> mx.array:
    """Keep tokens with p >= min_p * p_max (in log space: v >= v_max + log(min_p))."""
    threshold = mx.max(vals, axis=-1, keepdims=True) + log_min_p
    return mx.where(vals >= threshold, vals, _NEG_INF)


def mask_xtc(
    vals: mx.array, threshold: float | mx.array, apply: mx.array | None = None
) -> mx.array:
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


def gumbel_choice(vals: mx.array, key: mx.array) -> mx.array:
    """Index of a draw from each row's `softmax(vals)` (Gumbel-max with noise from `key`).

    The noise depends only on `key` and the row width, so a one-row call and row `i` of a
    batched call with key `i` draw alike (`mlxcel.engine.sampling.truncation.draw` relies
    on it).
    """
    return mx.argmax(vals + mx.random.gumbel(shape=vals.shape, key=key), axis=-1)


def chosen_tokens(choice: mx.array, idx: mx.array | None) -> mx.array:
    """Token ids of each row's drawn candidate position `choice` ([B]) among candidates
    `idx` ([B, width] token ids; None: the whole vocabulary in its own order)."""
    return choice if idx is None else mx.take_along_axis(idx, choice[:, None], axis=-1)[:, 0]


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
