"""Top-n-sigma, typical-p and dynamic temperature: llama.cpp's samplers, checked against a
plain transcription of llama.cpp's loops, through `make_distribution` (what a request is
drawn from), the batched sampler, `mlxcel generate` flags and the server's request fields."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from server_harness import ServeProcess

from mlxcel.config import parse_serve_args, resolve_settings
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.sampling.samplers import make_distribution

OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # only the sampler under test


def _reference_top_n_sigma(logits: np.ndarray, n: float) -> np.ndarray:
    """llama.cpp's llama_sampler_top_n_sigma_apply on one row (finite logits only)."""
    finite = logits[np.isfinite(logits)]
    mean = finite.sum() / len(finite)
    std = math.sqrt(((finite - mean) ** 2).sum() / len(finite))
    out = logits.copy()
    out[logits < logits.max() - n * std] = -np.inf
    return out


def _reference_typical(logits: np.ndarray, p: float) -> np.ndarray:
    """llama.cpp's llama_sampler_typical_apply (min_keep 0) on one row."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    entropy = -sum(q * math.log(q) for q in probs if q > 0)
    shifted = [abs(-math.log(q) - entropy) if q > 0 else math.inf for q in probs]
    order = sorted(range(len(probs)), key=lambda i: shifted[i])
    cum, last = 0.0, len(order)
    for i, token in enumerate(order):
        cum += probs[token]
        if cum > p:
            last = i + 1
            break
    out = np.full_like(logits, -np.inf)
    kept = order[:last]
    out[kept] = logits[kept]
    return out


def _reference_dynatemp(logits: np.ndarray, temp: float, delta: float, exp: float) -> np.ndarray:
    """llama.cpp's llama_sampler_temp_ext_apply (delta > 0) on the finite candidates."""
    finite = np.isfinite(logits)
    size = int(finite.sum())
    probs = np.exp(logits[finite] - logits[finite].max())
    probs /= probs.sum()
    entropy = -sum(q * math.log(q) for q in probs if q > 0)
    normalized = entropy / -math.log(1.0 / size)
    low, high = max(0.0, temp - delta), temp + delta
    return logits / (low + (high - low) * normalized**exp)


def _softmax(logits: np.ndarray) -> np.ndarray:
    out = np.zeros_like(logits)
    finite = np.isfinite(logits)
    e = np.exp(logits[finite] - logits[finite].max())
    out[finite] = e / e.sum()
    return out


def _distribution(params: SamplingParams, logits: np.ndarray) -> np.ndarray:
    row = mx.array(logits[None, :].astype(np.float32))
    logprobs = row - mx.logsumexp(row, axis=-1, keepdims=True)
    return np.exp(np.array(make_distribution(params)(logprobs)[0]))


ROWS = [
    np.random.default_rng(seed).normal(scale=scale, size=64)
    for seed, scale in [(0, 1.0), (1, 2.5), (2, 4.0), (3, 0.3)]
]


@pytest.mark.parametrize("row", range(len(ROWS)))
@pytest.mark.parametrize("n", [0.5, 1.0, 2.0])
def test_top_n_sigma_matches_llama_cpp(row: int, n: float) -> None:
    logits = ROWS[row]
    params = SamplingParams(temperature=1.0, top_n_sigma=n, **OFF)
    expected = _softmax(_reference_top_n_sigma(logits, n))
    np.testing.assert_allclose(_distribution(params, logits), expected, atol=1e-5)
    assert 0 < (expected > 0).sum() < len(logits)  # it removed some and kept some


@pytest.mark.parametrize("row", range(len(ROWS)))
@pytest.mark.parametrize("p", [0.2, 0.5, 0.9])
def test_typical_p_matches_llama_cpp(row: int, p: float) -> None:
    logits = ROWS[row]
    params = SamplingParams(temperature=1.0, typical_p=p, **OFF)
    expected = _softmax(_reference_typical(logits, p))
    np.testing.assert_allclose(_distribution(params, logits), expected, atol=1e-5)


def test_typical_p_can_drop_the_most_probable_token() -> None:
    # One token far above a flat rest: its surprise is far from the entropy.
    logits = np.zeros(32)
    logits[0] = 3.0
    probs = _distribution(SamplingParams(temperature=1.0, typical_p=0.5, **OFF), logits)
    assert probs[0] == 0.0 and probs[1:].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("row", range(len(ROWS)))
@pytest.mark.parametrize(
    ("temp", "delta", "exp"), [(0.8, 0.5, 1.0), (1.0, 1.5, 2.0), (0.5, 0.2, 0.5)]
)
def test_dynamic_temperature_matches_llama_cpp(
    row: int, temp: float, delta: float, exp: float
) -> None:
    logits = ROWS[row]
    params = SamplingParams(temperature=temp, dynatemp_range=delta, dynatemp_exponent=exp, **OFF)
    expected = _softmax(_reference_dynatemp(logits, temp, delta, exp))
    np.testing.assert_allclose(_distribution(params, logits), expected, atol=1e-5)


def test_dynamic_temperature_follows_the_entropy() -> None:
    """A flat row is sampled hotter than temp, a peaked one colder: the top token's share
    moves against plain temperature in opposite directions."""
    flat, peaked = ROWS[3], ROWS[2]
    for logits, hotter in ((flat, True), (peaked, False)):
        plain = _distribution(SamplingParams(temperature=1.0, **OFF), logits).max()
        dynamic = _distribution(
            SamplingParams(temperature=1.0, dynatemp_range=0.9, **OFF), logits
        ).max()
        assert (dynamic < plain) if hotter else (dynamic > plain)


def test_the_stages_run_in_llama_cpp_order() -> None:
    """top_n_sigma; top_k; typ_p; ... temperature: n-sigma sees the whole vocabulary, typical
    the top-k candidates renormalized, the dynamic temperature what is left."""
    logits = ROWS[1]
    params = SamplingParams(
        temperature=0.9,
        top_n_sigma=2.0,
        top_k=12,
        typical_p=0.7,
        top_p=1.0,
        min_p=0.0,
        dynatemp_range=0.4,
    )
    step = _reference_top_n_sigma(logits, 2.0)
    keep = np.argsort(-step)[:12]
    top_k = np.full_like(step, -np.inf)
    top_k[keep] = step[keep]
    expected = _softmax(_reference_dynatemp(_reference_typical(top_k, 0.7), 0.9, 0.4, 1.0))
    np.testing.assert_allclose(_distribution(params, logits), expected, atol=1e-5)


def test_the_off_values_change_nothing() -> None:
    logits = ROWS[0]
    base = SamplingParams(temperature=0.7)
    off = SamplingParams(temperature=0.7, top_n_sigma=-1.0, typical_p=1.0, dynatemp_range=0.0)
    np.testing.assert_array_equal(_distribution(base, logits), _distribution(off, logits))


def test_llama_server_flags_set_them() -> None:
    argv = [
        "--top-nsigma",
        "1.5",
        "--typical",
        "0.7",
        "--dynatemp-range",
        "0.3",
        "--dynatemp-exp",
        "2",
    ]
    settings = resolve_settings(cli=parse_serve_args(argv).cli, env={}).settings
    assert (settings.top_n_sigma, settings.typical_p) == (1.5, 0.7)
    assert (settings.dynatemp_range, settings.dynatemp_exponent) == (0.3, 2.0)


def test_served_requests_use_and_report_them(tiny_llama_dir: Any) -> None:
    import httpx

    server = ServeProcess(["-m", str(tiny_llama_dir), "--no-warmup", "--typical", "0.9"])
    server.start()
    try:
        props = httpx.get(f"{server.url}/props", timeout=30).json()
        defaults = props["default_generation_settings"]["params"]
        assert defaults["typical_p"] == pytest.approx(0.9)
        assert defaults["top_n_sigma"] == -1.0
        body = {
            "prompt": "Once upon a time",
            "n_predict": 6,
            "seed": 5,
            "top_n_sigma": 1.0,
            "typical_p": 0.5,
            "dynatemp_range": 0.4,
            "dynatemp_exponent": 1.5,
        }
        first = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        again = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        assert first["content"] == again["content"]  # seeded: reproducible
        params = first["generation_settings"]
        assert (params["top_n_sigma"], params["typical_p"]) == (1.0, 0.5)
        assert (params["dynatemp_range"], params["dynatemp_exponent"]) == (0.4, 1.5)
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "typical_p": 0.0}
        bad = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
        assert bad.status_code == 400 and "typical_p" in bad.json()["error"]["message"]
    finally:
        server.stop()
