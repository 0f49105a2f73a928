"""Sampler chain and logits processors against hand-computed distributions."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlxcel.engine.sampling import SamplingParams, make_sampling
from mlxcel.engine.sampling.chain import make_logits_processors
from mlxcel.engine.sampling.processors import (
    dry_penalties,
    make_dry,
    make_frequency_presence_penalty,
    make_logit_bias,
    make_repetition_penalty,
)
from mlxcel.engine.sampling.samplers import greedy, make_distribution, make_sampler

# Every truncation stage off, temperature 1: the model's own distribution.
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
FAST = settings(max_examples=40, deadline=None, derandomize=True)


def logprobs_of(probs: list[float]) -> mx.array:
    """`[1, V]` log-probabilities of a hand-written distribution (0 -> -inf)."""
    with np.errstate(divide="ignore"):
        return mx.array(np.log(np.asarray(probs, dtype=np.float64))[None, :].astype(np.float32))


def normalized(logits: list[float] | np.ndarray) -> mx.array:
    x = mx.array(np.asarray(logits, dtype=np.float32)[None, :])
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def probs_after(params: SamplingParams, logprobs: mx.array) -> np.ndarray:
    """The distribution the sampler would draw from, as numpy probabilities."""
    return np.exp(np.array(make_distribution(params)(logprobs)))[0]


def token_of(sampled: mx.array) -> int:
    """The single token id of a `[1]` sampler result."""
    return int(np.array(sampled)[0])


def assert_probs(actual: np.ndarray, expected: list[float]) -> None:
    np.testing.assert_allclose(actual, np.asarray(expected), atol=1e-5)


# -- SamplingParams ----------------------------------------------------------------------


def test_defaults_are_llama_server_defaults_and_valid() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repetition_penalty, p.dry_multiplier, p.xtc_probability) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logit_bias == () and not p.greedy
    p.validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("repetition_penalty", 0.0),
        ("repetition_context_size", -2),
        ("penalty_context_size", -5),
        ("frequency_penalty", math.inf),
        ("dry_multiplier", -1.0),
        ("dry_base", -0.5),
        ("dry_allowed_length", 0),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", (1, -3)),
        ("xtc_probability", 1.5),
        ("xtc_threshold", -0.1),
        ("typical_p", 0.0),
        ("typical_p", 1.2),
        ("dynatemp_range", -0.5),
        ("dynatemp_exponent", -1.0),
        ("top_n_sigma", math.nan),
        ("top_k", 2.5),
        ("seed", "7"),
        ("logit_bias", ((1, math.nan),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((1, math.inf),)),
    ],
)
def test_validate_rejects_out_of_range(field: str, value: Any) -> None:
    params = replace(SamplingParams(), **{field: value})
    with pytest.raises(ValueError) as info:
        params.validate()
    assert field.split("_")[0] in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError):
        make_sampling(params, 100)


def test_validate_accepts_edge_values() -> None:
    SamplingParams(
        temperature=0.0,
        top_k=-1,
        top_p=1.0,
        min_p=0.0,
        repetition_context_size=-1,
        dry_penalty_last_n=-1,
        xtc_probability=1.0,
        seed=-1,
        logit_bias=((3, -math.inf),),
    ).validate()


# -- greedy, temperature ---------------------------------------------------------------


def test_greedy_is_argmax_whatever_the_truncation() -> None:
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9, p_less=True)
    sampler, processors = make_sampling(params, 5)
    assert sampler is greedy and processors == []
    x = logprobs_of([0.1, 0.2, 0.4, 0.2, 0.1])
    assert sampler(x).tolist() == [2]
    assert_probs(probs_after(params, x), [0, 0, 1, 0, 0])


def test_temperature_scales_logits() -> None:
    # logits [0, ln 2]: T=0.5 -> weights [1, 4]; T=2 -> [1, sqrt 2].
    x = logprobs_of([1 / 3, 2 / 3])
    assert_probs(probs_after(replace(PLAIN, temperature=0.5), x), [0.2, 0.8])
    r = math.sqrt(2)
    assert_probs(probs_after(replace(PLAIN, temperature=2.0), x), [1 / (1 + r), r / (1 + r)])


# -- top-k -------------------------------------------------------------------------------


def test_top_k_hand_computed() -> None:
    x = normalized([1.0, 2.0, 3.0, 4.0, 5.0])
    e4, e5 = math.exp(4), math.exp(5)
    assert_probs(probs_after(replace(PLAIN, top_k=2), x), [0, 0, 0, e4 / (e4 + e5), e5 / (e4 + e5)])
    full = np.exp(np.array(x))[0].tolist()
    for k in (0, -1, 5, 6, 1000):  # off, or at least the vocabulary: keep everything
        assert_probs(probs_after(replace(PLAIN, top_k=k), x), full)


@FAST
@given(
    st.lists(st.integers(-50, 50), min_size=2, max_size=12, unique=True),
    st.integers(1, 12),
)
def test_top_k_keeps_exactly_the_k_highest(logits: list[int], k: int) -> None:
    probs = probs_after(replace(PLAIN, top_k=k), normalized([v / 10 for v in logits]))
    kept = set(np.flatnonzero(probs > 0).tolist())
    expected = set(np.argsort(-np.asarray(logits))[: min(k, len(logits))].tolist())
    assert kept == expected
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)


def test_top_k_sampler_returns_vocabulary_ids() -> None:
    x = logprobs_of([0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.93])
    sampler = make_sampler(replace(PLAIN, top_k=1, seed=3))
    assert {token_of(sampler(x)) for _ in range(5)} == {7}
    sampler = make_sampler(replace(PLAIN, top_k=2, seed=3))
    rows = mx.concatenate([logprobs_of([0.4, 0.05, 0.05, 0.3, 0.2])] * 400)
    assert set(np.array(sampler(rows)).tolist()) == {0, 3}


# -- top-p -------------------------------------------------------------------------------


def test_top_p_hand_computed() -> None:
    x = logprobs_of([0.5, 0.3, 0.15, 0.05])
    assert_probs(probs_after(replace(PLAIN, top_p=0.7), x), [0.625, 0.375, 0, 0])
    assert_probs(
        probs_after(replace(PLAIN, top_p=0.85), x), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )
    assert_probs(probs_after(replace(PLAIN, top_p=0.4), x), [1, 0, 0, 0])
    assert_probs(probs_after(replace(PLAIN, top_p=1.0), x), [0.5, 0.3, 0.15, 0.05])


@FAST
@given(
    st.lists(st.floats(0.01, 1.0), min_size=2, max_size=10),
    st.floats(0.05, 0.99),
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(weights: list[float], top_p: float) -> None:
    probs = np.asarray(weights) / sum(weights)
    out = probs_after(replace(PLAIN, top_p=top_p), logprobs_of(probs.tolist()))
    kept = out > 0
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    # Skip float ties: between tokens, or with the boundary.
    assume(np.all(np.abs(mass_before - top_p) > 1e-4))
    assume(np.all(-np.diff(probs[order]) > 1e-4))
    np.testing.assert_array_equal(kept[order], mass_before < top_p)
    assert kept[np.argmax(probs)]
    # Survivors keep their relative weights.
    np.testing.assert_allclose(out[kept], probs[kept] / probs[kept].sum(), atol=1e-5)


# -- min-p -------------------------------------------------------------------------------


def test_min_p_hand_computed() -> None:
    x = logprobs_of([0.5, 0.3, 0.15, 0.05])
    # min_p 0.2: keep p >= 0.1.
    assert_probs(
        probs_after(replace(PLAIN, min_p=0.2), x), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]
    )
    assert_probs(probs_after(replace(PLAIN, min_p=1.0), x), [1, 0, 0, 0])
    assert_probs(probs_after(replace(PLAIN, min_p=0.0), x), [0.5, 0.3, 0.15, 0.05])


@FAST
@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=10), st.floats(0.0, 1.0))
def test_min_p_invariants(weights: list[float], min_p: float) -> None:
    probs = np.asarray(weights) / sum(weights)
    out = probs_after(replace(PLAIN, min_p=min_p), logprobs_of(probs.tolist()))
    threshold = min_p * probs.max()
    clear = np.abs(probs - threshold) > 1e-5
    np.testing.assert_array_equal((out > 0)[clear], (probs >= threshold)[clear])
    assert out[np.argmax(probs)] > 0
    # A larger min_p never keeps more tokens.
    stricter = probs_after(replace(PLAIN, min_p=min(1.0, min_p + 0.2)), logprobs_of(probs.tolist()))
    assert set(np.flatnonzero(stricter > 0)) <= set(np.flatnonzero(out > 0))


# -- order of the chain -------------------------------------------------------------------


def test_top_p_sees_the_distribution_renormalized_after_top_k() -> None:
    x = logprobs_of([0.4, 0.3, 0.2, 0.1])
    # Alone, the mass before the third token is 0.7 < 0.75: three tokens stay.
    assert_probs(probs_after(replace(PLAIN, top_p=0.75), x), [4 / 9, 3 / 9, 2 / 9, 0])
    # After top_k=3 it is 7/9 >= 0.75: two tokens stay.
    assert_probs(probs_after(replace(PLAIN, top_k=3, top_p=0.75), x), [4 / 7, 3 / 7, 0, 0])


def test_min_p_applies_before_temperature() -> None:
    x = logprobs_of([0.5, 0.3, 0.2])
    # min_p 0.5 keeps p >= 0.25 of the untempered distribution, then T=0.5 squares.
    params = replace(PLAIN, min_p=0.5, temperature=0.5)
    assert_probs(probs_after(params, x), [0.25 / 0.34, 0.09 / 0.34, 0])


# -- p-less ------------------------------------------------------------------------------


def test_p_less_hand_computed() -> None:
    # sum p^2 = 0.365: only 0.5 survives.
    assert_probs(
        probs_after(replace(PLAIN, p_less=True), logprobs_of([0.5, 0.3, 0.15, 0.05])), [1, 0, 0, 0]
    )
    # sum p^2 = 0.345: 0.4 and 0.35 survive.
    x = logprobs_of([0.4, 0.35, 0.25])
    assert_probs(probs_after(replace(PLAIN, p_less=True), x), [0.4 / 0.75, 0.35 / 0.75, 0])
    # A uniform distribution keeps everything (p == sum p^2).
    assert_probs(probs_after(replace(PLAIN, p_less=True), logprobs_of([0.25] * 4)), [0.25] * 4)


def test_p_less_applies_after_temperature() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    tempered = np.sqrt(probs) / np.sqrt(probs).sum()  # T = 2
    keep = tempered >= (tempered**2).sum()
    assert keep.tolist() == [True, True, False, False]
    expected = np.where(keep, tempered, 0) / tempered[keep].sum()
    out = probs_after(replace(PLAIN, temperature=2.0, p_less=True), logprobs_of(probs.tolist()))
    assert_probs(out, expected.tolist())


@FAST
@given(st.lists(st.floats(0.001, 1.0), min_size=1, max_size=10))
def test_p_less_always_keeps_the_argmax(weights: list[float]) -> None:
    probs = np.asarray(weights) / sum(weights)
    out = probs_after(replace(PLAIN, p_less=True), logprobs_of(probs.tolist()))
    assert out[np.argmax(probs)] > 0
    assert out.sum() == pytest.approx(1.0, abs=1e-5)


# -- XTC ---------------------------------------------------------------------------------


def test_xtc_probability_one_removes_top_choices_but_the_least() -> None:
    x = logprobs_of([0.4, 0.3, 0.2, 0.1])
    params = replace(PLAIN, xtc_probability=1.0, xtc_threshold=0.25)
    assert_probs(probs_after(params, x), [0, 0.5, 1 / 3, 1 / 6])
    # Only one token above the threshold: nothing is removed.
    one = replace(params, xtc_threshold=0.35)
    assert_probs(probs_after(one, x), [0.4, 0.3, 0.2, 0.1])
    # The sampler never draws the excluded token.
    sampler = make_sampler(replace(params, seed=11))
    rows = mx.concatenate([x] * 500)
    assert 0 not in set(np.array(sampler(rows)).tolist())


def test_xtc_probability_zero_is_a_no_op() -> None:
    x = logprobs_of([0.4, 0.3, 0.2, 0.1])
    params = replace(PLAIN, xtc_probability=0.0, xtc_threshold=0.25)
    assert_probs(probs_after(params, x), [0.4, 0.3, 0.2, 0.1])


def test_xtc_applies_with_its_probability() -> None:
    # With probability 0.5 the top token is excluded: it is drawn about half as often.
    x = logprobs_of([0.5, 0.5 - 1e-3, 1e-3])
    sampler = make_sampler(replace(PLAIN, xtc_probability=0.5, xtc_threshold=0.2, seed=5))
    tokens = np.array(sampler(mx.concatenate([x] * 4000)))
    share = float((tokens == 0).mean())
    assert 0.2 < share < 0.3  # 0.5 * 0.5 expected


# -- the categorical draw and seeds --------------------------------------------------------


def test_sampler_draws_with_the_expected_frequencies() -> None:
    x = logprobs_of([0.1, 0.6, 0.0, 0.3])
    sampler = make_sampler(replace(PLAIN, seed=1234))
    tokens = np.array(sampler(mx.concatenate([x] * 6000)))
    counts = np.bincount(tokens, minlength=4) / tokens.size
    np.testing.assert_allclose(counts, [0.1, 0.6, 0.0, 0.3], atol=0.03)
    assert counts[2] == 0


@FAST
@given(st.integers(0, 2**64 - 1), st.sampled_from([0, 3, 40]), st.booleans())
def test_same_seed_same_tokens(seed: int, top_k: int, p_less: bool) -> None:
    params = SamplingParams(temperature=1.2, top_k=top_k, top_p=0.9, p_less=p_less, seed=seed)
    x = normalized(np.linspace(-2, 2, 64))
    a, b = make_sampler(params), make_sampler(params)
    first = [token_of(a(x)) for _ in range(8)]
    mx.random.seed(seed % 1000)  # the global random state does not matter
    second = [token_of(b(x)) for _ in range(8)]
    assert first == second


def test_different_or_no_seed_gives_different_tokens() -> None:
    x = normalized(np.zeros(1000))
    params = replace(PLAIN, seed=1)

    def draw(p: SamplingParams) -> list[int]:
        sampler = make_sampler(p)
        return [token_of(sampler(x)) for _ in range(12)]

    assert len(set(draw(params))) > 1  # the key advances at every call
    assert draw(params) != draw(replace(params, seed=2))
    assert draw(replace(params, seed=None)) != draw(replace(params, seed=None))
    assert draw(replace(params, seed=-1)) != draw(replace(params, seed=-1))


def test_sampler_is_lazy_and_typed_like_mlx_lm() -> None:
    sampler = make_sampler(SamplingParams(seed=0))
    out = sampler(normalized(np.linspace(0, 1, 100)))
    assert out.shape == (1,) and out.dtype == mx.uint32
    assert greedy(normalized([0.0, 1.0])).dtype == mx.uint32


# -- penalties ---------------------------------------------------------------------------


def apply(processor: object, context: list[int], logits: list[float]) -> list[float]:
    assert callable(processor)
    out = processor(mx.array(context, dtype=mx.int32), mx.array([logits]))
    return np.array(out)[0].tolist()


def test_repetition_penalty_hand_computed() -> None:
    logits = [2.0, -2.0, 1.0, 0.5, 3.0]
    proc = make_repetition_penalty(2.0, 64)
    # Each distinct token once: positive halved, negative doubled.
    assert apply(proc, [0, 1, 1], logits) == [1.0, -4.0, 1.0, 0.5, 3.0]
    window = make_repetition_penalty(2.0, 2)
    assert apply(window, [0, 1, 2], logits) == [2.0, -4.0, 0.5, 0.5, 3.0]
    whole = make_repetition_penalty(2.0, -1)
    assert apply(whole, [4, 0, 1, 2], logits) == [1.0, -4.0, 0.5, 0.5, 1.5]
    assert apply(proc, [], logits) == logits
    assert make_repetition_penalty(1.0, 64) is None
    assert make_repetition_penalty(1.3, 0) is None


def test_frequency_and_presence_penalties_hand_computed() -> None:
    zeros = [0.0] * 5
    proc = make_frequency_presence_penalty(0.5, 0.25, 64)
    # token 1 three times: 3 * 0.5 + 0.25; token 2 once: 0.5 + 0.25.
    assert apply(proc, [1, 1, 2, 1], zeros) == [0.0, -1.75, -0.75, 0.0, 0.0]
    window = make_frequency_presence_penalty(0.5, 0.25, 2)
    assert apply(window, [1, 1, 2, 1], zeros) == [0.0, -0.75, -0.75, 0.0, 0.0]
    only_presence = make_frequency_presence_penalty(0.0, 1.0, -1)
    assert apply(only_presence, [3, 3, 3], zeros) == [0.0, 0.0, 0.0, -1.0, 0.0]
    assert make_frequency_presence_penalty(0.0, 0.0, 64) is None
    assert make_frequency_presence_penalty(0.5, 0.5, 0) is None


@FAST
@given(
    st.lists(st.floats(-5, 5), min_size=6, max_size=6),
    st.lists(st.integers(0, 5), min_size=1, max_size=10),
    st.floats(1.0, 3.0),
    st.floats(0.0, 2.0),
    st.floats(0.0, 2.0),
)
def test_penalties_only_ever_lower_the_repeated_tokens(
    logits: list[float], context: list[int], rep: float, freq: float, pres: float
) -> None:
    window = set(context[-4:])
    procs = make_logits_processors(
        replace(
            SamplingParams(),
            repetition_penalty=rep,
            repetition_context_size=4,
            frequency_penalty=freq,
            presence_penalty=pres,
            penalty_context_size=4,
        ),
        6,
    )
    out = mx.array([logits])
    for proc in procs:
        out = proc(mx.array(context), out)
    result = np.array(out)[0]
    for token, (before, after) in enumerate(zip(logits, result, strict=True)):
        if token in window:
            assert after <= before + 1e-5
            stronger = make_frequency_presence_penalty(freq + 1, pres, 4)
            assert stronger is not None
            assert apply(stronger, context, logits)[token] < before
        else:
            assert after == pytest.approx(before)


def test_logit_bias_adds_and_bans() -> None:
    proc = make_logit_bias(((1, 2.0), (3, -math.inf), (1, 0.5)), 5)
    assert apply(proc, [0], [0.0, 1.0, 0.0, 0.0, 0.0]) == [0.0, 1.5, 0.0, -math.inf, 0.0]
    assert make_logit_bias((), 5) is None
    with pytest.raises(ValueError, match="logit_bias"):
        make_logit_bias(((5, 1.0),), 5)


def test_processors_keep_the_logits_dtype() -> None:
    logits = mx.zeros((1, 6), dtype=mx.bfloat16)
    context = mx.array([1, 2, 1, 2, 1], dtype=mx.int32)
    params = replace(
        SamplingParams(),
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        dry_multiplier=0.8,
        logit_bias=((0, 1.0),),
    )
    procs = make_logits_processors(params, 6)
    assert len(procs) == 4
    for proc in procs:
        logits = proc(context, logits)
        assert logits.dtype == mx.bfloat16


# -- DRY ---------------------------------------------------------------------------------


def dry_dict(context: list[int], breakers: tuple[int, ...] = (), **kw: float) -> dict[int, float]:
    args = {"multiplier": 0.8, "base": 1.75, "allowed_length": 2} | kw
    ids, values = dry_penalties(
        np.asarray(context),
        float(args["multiplier"]),
        float(args["base"]),
        int(args["allowed_length"]),
        np.asarray(breakers, dtype=np.int64),
    )
    return {int(i): float(v) for i, v in zip(ids, values, strict=True)}


def test_dry_hand_computed() -> None:
    # "1 2 3" ends the context and occurred before, followed by 4: match length 3.
    assert dry_dict([1, 2, 3, 4, 9, 1, 2, 3]) == pytest.approx({4: 0.8 * 1.75})
    # Two earlier occurrences: "0 1 2" -> 5 (length 3) and "1 2" -> 6 (length 2).
    context = [0, 1, 2, 5, 7, 1, 2, 6, 0, 1, 2]
    assert dry_dict(context) == pytest.approx({5: 0.8 * 1.75, 6: 0.8})
    assert dry_dict(context, allowed_length=3) == pytest.approx({5: 0.8})
    assert dry_dict(context, allowed_length=4) == {}
    # A run of one token overlaps itself: "5 5 5" (length 3) followed by 5.
    assert dry_dict([5, 5, 5, 5]) == pytest.approx({5: 0.8 * 1.75})
    assert dry_dict([1, 2, 3]) == {} and dry_dict([1]) == {}


def test_dry_sequence_breakers_stop_matches() -> None:
    context = [1, 2, 3, 4, 5, 1, 2, 3]
    assert dry_dict(context, breakers=(5,)) == pytest.approx({4: 0.8 * 1.75})
    # 2 is a breaker: the suffix is only "3", shorter than allowed_length.
    assert dry_dict(context, breakers=(2,)) == {}
    # The last token is a breaker: nothing to extend.
    assert dry_dict([1, 2, 1, 2], breakers=(2,)) == {}


def naive_dry(context: list[int], allowed: int, breakers: set[int]) -> dict[int, int]:
    """Longest match length per candidate, by brute force."""
    n = len(context)
    limit = n - 1
    for j in range(n - 1, -1, -1):
        if context[j] in breakers:
            limit = min(limit, n - 1 - j)
            break
    best: dict[int, int] = {}
    for i in range(n - 1):
        length = 0
        while length < limit and i - length >= 0 and context[i - length] == context[n - 1 - length]:
            length += 1
        if length >= allowed:
            token = context[i + 1]
            best[token] = max(best.get(token, 0), length)
    return best


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=40),
    st.integers(1, 4),
    st.sets(st.integers(0, 3), max_size=1),
)
def test_dry_matches_brute_force(context: list[int], allowed: int, breakers: set[int]) -> None:
    got = dry_dict(context, tuple(breakers), multiplier=1.0, base=2.0, allowed_length=allowed)
    expected = {t: 2.0 ** (n - allowed) for t, n in naive_dry(context, allowed, breakers).items()}
    assert got == pytest.approx(expected)


def test_dry_processor_window_and_incremental_context() -> None:
    context = [1, 2, 3, 4, 9, 9, 9, 1, 2, 3]
    proc = make_dry(0.8, 1.75, 2, 0)
    assert proc is not None
    out = apply(proc, context, [0.0] * 10)
    assert out[4] == pytest.approx(-1.4) and sum(out) == pytest.approx(-1.4)
    # A window that no longer holds the earlier "1 2 3 4": no penalty.
    assert apply(make_dry(0.8, 1.75, 2, 6), context, [0.0] * 10) == [0.0] * 10
    # Growing the context token by token gives what a fresh processor computes.
    rng = np.random.default_rng(0)
    grown = rng.integers(0, 4, size=30).tolist()
    for n in range(1, len(grown) + 1):
        fresh = make_dry(0.8, 1.75, 2, 0)
        assert apply(proc, grown[:n], [0.0] * 10) == pytest.approx(
            apply(fresh, grown[:n], [0.0] * 10)
        )
    # An unrelated (new) context is not mistaken for a continuation.
    assert apply(proc, [7, 8, 7], [0.0] * 10) == [0.0] * 10
    assert apply(proc, [1, 2, 3, 4, 9, 1, 2, 3], [0.0] * 10)[4] == pytest.approx(-1.4)
    other = apply(proc, [5, 6, 7, 8, 0, 5, 6, 7, 8, 0], [0.0] * 10)
    assert other[5] == pytest.approx(-0.8 * 1.75**3) and other[4] == 0.0
    assert make_dry(0.0, 1.75, 2, 0) is None


def test_dry_penalty_is_capped() -> None:
    context = [3] * 600
    ids, values = dry_penalties(np.asarray(context), 1.0, 1.75, 2)
    assert ids.tolist() == [3] and math.isfinite(float(values[0])) and values[0] >= 1e29


# -- the whole chain ---------------------------------------------------------------------


def test_make_sampling_builds_only_what_is_on() -> None:
    sampler, processors = make_sampling(SamplingParams(), 32)
    assert callable(sampler) and processors == []
    params = replace(
        SamplingParams(),
        repetition_penalty=1.1,
        presence_penalty=0.5,
        dry_multiplier=0.8,
        logit_bias=((1, 1.0),),
    )
    assert len(make_sampling(params, 32)[1]) == 4


def test_chain_applies_like_mlx_lm_calls_it() -> None:
    # As GenerationBatch._step: processors on raw logits, then the sampler on log-softmax.
    params = replace(PLAIN, temperature=0.0, logit_bias=((0, -math.inf),), repetition_penalty=4.0)
    sampler, processors = make_sampling(params, 4)
    context = mx.array([1, 1, 2], dtype=mx.int32)
    logits = mx.array([[9.0, 4.0, 3.0, 2.0]])
    for proc in processors:
        logits = proc(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    # 0 is banned, 1 -> 1.0 and 2 -> 0.75 by the repetition penalty: 3 wins.
    assert sampler(logprobs).tolist() == [3]


def test_with_mlx_lm_batch_generator() -> None:
    """The contract: per-sequence samplers and processors inside BatchGenerator, reproducible."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=40,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    requests = [
        replace(
            SamplingParams(seed=5, temperature=1.5, dry_multiplier=0.8, repetition_penalty=1.3),
            presence_penalty=0.5,
            logit_bias=((0, -math.inf),),
        ),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=9, top_k=0, p_less=True, xtc_probability=0.5),
    ]

    def run() -> list[list[int]]:
        gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
        built = [make_sampling(p, args.vocab_size) for p in requests]
        uids = gen.insert(
            [[1, 2, 3, 4, 1, 2, 3]] * len(requests),
            max_tokens=[8] * len(requests),
            samplers=[s for s, _ in built],
            logits_processors=[ps for _, ps in built],
        )
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(int(r.token))
        gen.close()
        return [out[uid] for uid in uids]

    first = run()
    assert [len(tokens) for tokens in first] == [8, 8, 8]
    assert 0 not in first[0]  # banned by logit_bias
    assert run() == first
