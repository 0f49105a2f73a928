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


# -- Mirostat ------------------------------------------------------------------------------


def _reference_mirostat_keep(sorted_logits: np.ndarray, mu: float, version: int) -> int:
    """How many of the sorted candidates llama.cpp's mirostat (1) / mirostat_v2 (2) keep."""
    probs = np.exp(sorted_logits - sorted_logits.max())
    probs /= probs.sum()
    if version == 2:
        kept = next((i for i, q in enumerate(probs) if -math.log2(q) > mu), len(probs))
        return max(kept, 1)
    sum_tb = sum_tt = 0.0
    for i in range(min(99, len(probs) - 1)):
        t = math.log((i + 2) / (i + 1))
        b = math.log(probs[i] / probs[i + 1])
        sum_tb += t * b
        sum_tt += t * t
    s_hat = sum_tb / sum_tt
    epsilon = s_hat - 1
    k = (epsilon * 2**mu / (1 - len(probs) ** -epsilon)) ** (1 / s_hat)
    return min(max(int(k), 1), len(probs))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mu", [1.0, 3.0, 6.0, 10.0])
@pytest.mark.parametrize("row", range(len(ROWS)))
def test_mirostat_truncation_matches_llama_cpp(version: int, mu: float, row: int) -> None:
    from mlxcel.engine.sampling.stages import mirostat_mask

    logits = np.sort(np.concatenate([ROWS[row], ROWS[row] * 0.5 - 3]))[::-1].copy()
    vals = mirostat_mask(mx.array(logits[None, :].astype(np.float32)), mx.array([[mu]]), version)
    kept = int(np.isfinite(np.array(vals)).sum())
    assert kept == _reference_mirostat_keep(logits.astype(np.float32), mu, version)


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_updates_mu_by_the_surprise_of_each_draw(version: int) -> None:
    """The sampler's mu follows llama.cpp's rule mu -= eta * (surprise - tau), the surprise
    measured on the truncated distribution, and every draw comes from the kept tokens."""
    from mlxcel.engine.sampling.samplers import make_sampler

    tau, eta, temp = 3.0, 0.3, 0.9
    params = SamplingParams(
        temperature=temp, mirostat=version, mirostat_tau=tau, mirostat_eta=eta, seed=4
    )
    sampler = make_sampler(params)
    rng = np.random.default_rng(7)
    mu = 2 * tau
    for _ in range(30):
        logits = rng.normal(scale=3.0, size=128).astype(np.float32)
        row = mx.array(logits[None, :])
        token = int(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item())
        recorded = float(sampler.draw_states[-1][1].item())  # type: ignore[attr-defined]
        assert recorded == pytest.approx(mu, abs=1e-4)
        order = np.argsort(-logits, kind="stable")
        scaled = (logits / temp)[order]
        kept = _reference_mirostat_keep(scaled, mu, version)
        assert token in set(order[:kept].tolist())
        probs = np.exp(scaled[:kept] - scaled[:kept].max())
        probs /= probs.sum()
        surprise = -math.log2(probs[list(order[:kept]).index(token)])
        mu -= eta * (surprise - tau)


def test_mirostat_2_holds_the_surprise_near_tau() -> None:
    from mlxcel.engine.sampling.samplers import make_sampler

    tau = 2.5
    sampler = make_sampler(SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, seed=1))
    logits = mx.array(np.random.default_rng(3).normal(scale=2.0, size=(1, 256)).astype(np.float32))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    full = np.array(logprobs[0]) / -math.log(2)  # surprise under the whole distribution
    seen = [full[int(sampler(logprobs).item())] for _ in range(400)]
    plain = float((np.exp(np.array(logprobs[0])) * full).sum())  # entropy, untruncated
    assert plain > tau + 1.5  # the model alone is much more surprising than the target
    assert np.mean(seen[100:]) < plain - 1.0  # Mirostat pulls the draws toward tau


def test_mirostat_flags_and_request_fields(tiny_llama_dir: Any) -> None:
    import httpx

    argv = ["--mirostat", "2", "--mirostat-lr", "0.2", "--mirostat-ent", "3"]
    settings = resolve_settings(cli=parse_serve_args(argv).cli, env={}).settings
    assert (settings.mirostat, settings.mirostat_eta, settings.mirostat_tau) == (2, 0.2, 3.0)
    server = ServeProcess(["-m", str(tiny_llama_dir), "--no-warmup", "--mirostat", "1"])
    server.start()
    try:
        props = httpx.get(f"{server.url}/props", timeout=30).json()
        assert props["default_generation_settings"]["params"]["mirostat"] == 1
        body = {
            "prompt": "Once upon a time",
            "n_predict": 8,
            "seed": 3,
            "mirostat": 2,
            "mirostat_tau": 4.0,
            "mirostat_eta": 0.2,
            "n_probs": 3,
            "post_sampling_probs": True,
        }
        first = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        again = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        assert first["content"] == again["content"]
        assert first["completion_probabilities"] == again["completion_probabilities"]
        params = first["generation_settings"]
        assert (params["mirostat"], params["mirostat_tau"], params["mirostat_eta"]) == (2, 4.0, 0.2)
        bad = httpx.post(f"{server.url}/completion", json={**body, "mirostat": 3}, timeout=30)
        assert bad.status_code == 400 and "mirostat" in bad.json()["error"]["message"]
    finally:
        server.stop()


def _assert_batched_post_matches_its_closure(params: SamplingParams, seed: int) -> None:
    """A stateful sampler's batched row records, draw after draw, the distribution that
    `post_sampling_of` rebuilds from the request's own closure (which keeps each draw's
    state); both draw the same tokens."""
    from mlxcel.engine.sampling.batched import BatchSampler, RowSampling
    from mlxcel.engine.sampling.samplers import make_sampler, post_sampling_of

    row = RowSampling(params, 96, post_probs=4)
    closure = make_sampler(params)
    batch = BatchSampler()
    rng = np.random.default_rng(seed)
    for _ in range(12):
        x = mx.array(rng.normal(scale=2.5, size=(1, 96)).astype(np.float32))
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        token = int(batch.sample([row], lp).item())
        assert int(closure(lp).item()) == token
        got = row.take_post(token)
        again = post_sampling_of(params, lp[0], token, 4, closure)
        assert got is not None
        assert got[0] == pytest.approx(again[0], abs=1e-5)
        assert [t for t, _ in got[1]] == [t for t, _ in again[1]]
        assert len(got[1]) >= 1 and got[0] <= 0.0


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_post_sampling_batched_and_recomputed_agree(version: int) -> None:
    params = SamplingParams(temperature=0.9, mirostat=version, mirostat_tau=3.0, seed=5)
    _assert_batched_post_matches_its_closure(params, version)


# -- adaptive-p -----------------------------------------------------------------------------


def _reference_adaptive(logits: np.ndarray, target: float, average: float) -> np.ndarray:
    """llama.cpp's llama_sampler_adaptive_p_apply transform on one row's finite logits."""
    probs = _softmax(logits)
    adapted = min(max(2 * target - average, 0.0), 1.0)
    out = np.full_like(logits, -np.inf)
    for i in np.flatnonzero(np.isfinite(logits)):
        d = abs(probs[i] - adapted) / 0.3
        out[i] = 5.0 - 10.0 * d * d / (1.0 + d)
    return out


@pytest.mark.parametrize("row", range(len(ROWS)))
@pytest.mark.parametrize("target", [0.0, 0.2, 0.5, 0.9])
def test_adaptive_p_reshapes_as_llama_cpp(row: int, target: float) -> None:
    """The first draw (average primed at the target), after top-k 20 and temperature 0.8."""
    logits = ROWS[row]
    params = SamplingParams(temperature=0.8, top_k=20, top_p=1.0, min_p=0.0, adaptive_target=target)
    keep = np.argsort(-logits)[:20]
    chain = np.full_like(logits, -np.inf)
    chain[keep] = logits[keep] / 0.8
    expected = _softmax(_reference_adaptive(chain, target, target))
    np.testing.assert_allclose(_distribution(params, logits), expected, atol=1e-5)


def test_adaptive_p_running_average_follows_llama_cpp() -> None:
    """The average is llama.cpp's weighted_sum / total_weight of the drawn tokens' original
    probabilities, primed as if on target."""
    from mlxcel.engine.sampling.samplers import make_sampler

    target, decay = 0.4, 0.7
    params = SamplingParams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        adaptive_target=target,
        adaptive_decay=decay,
        seed=9,
    )
    sampler = make_sampler(params)
    weighted, total = target / (1 - decay), 1 / (1 - decay)
    rng = np.random.default_rng(11)
    for _ in range(25):
        logits = rng.normal(scale=2.0, size=64).astype(np.float32)
        row = mx.array(logits[None, :])
        token = int(sampler(row - mx.logsumexp(row, axis=-1, keepdims=True)).item())
        recorded = float(sampler.draw_states[-1][1].item())  # type: ignore[attr-defined]
        assert recorded == pytest.approx(weighted / total, abs=1e-5)
        weighted = _softmax(logits.astype(np.float64))[token] + decay * weighted
        total = 1 + decay * total


def test_adaptive_p_pulls_the_drawn_probability_toward_its_target() -> None:
    """One token holds 90 %: plain sampling draws it ~90 % of the time; with target 0.3 the
    average original probability of the drawn tokens falls far below."""
    from mlxcel.engine.sampling.samplers import make_sampler

    probs = np.full(21, 0.1 / 20)
    probs[0] = 0.9
    logprobs = mx.array(np.log(probs)[None, :].astype(np.float32))
    off = dict(top_k=0, top_p=1.0, min_p=0.0, seed=2)
    runs = {}
    for target in (-1.0, 0.3):
        sampler = make_sampler(SamplingParams(temperature=1.0, adaptive_target=target, **off))
        drawn = [int(sampler(logprobs).item()) for _ in range(300)]
        runs[target] = float(np.mean(probs[drawn[50:]]))
    assert runs[-1.0] > 0.75
    assert 0.05 < runs[0.3] < 0.6


def test_adaptive_p_post_sampling_batched_and_recomputed_agree() -> None:
    params = SamplingParams(temperature=0.9, adaptive_target=0.35, adaptive_decay=0.6, seed=6)
    _assert_batched_post_matches_its_closure(params, 12)


def test_adaptive_p_flags_and_request_fields(tiny_llama_dir: Any) -> None:
    import httpx

    argv = ["--adaptive-target", "0.4", "--adaptive-decay", "0.5"]
    settings = resolve_settings(cli=parse_serve_args(argv).cli, env={}).settings
    assert (settings.adaptive_target, settings.adaptive_decay) == (0.4, 0.5)
    server = ServeProcess(["-m", str(tiny_llama_dir), "--no-warmup", "--adaptive-target", "0.5"])
    server.start()
    try:
        props = httpx.get(f"{server.url}/props", timeout=30).json()
        assert props["default_generation_settings"]["params"]["adaptive_target"] == 0.5
        body = {
            "prompt": "Once upon a time",
            "n_predict": 8,
            "seed": 3,
            "adaptive_target": 0.2,
            "adaptive_decay": 0.8,
        }
        first = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        again = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
        assert first["content"] == again["content"]
        params = first["generation_settings"]
        assert (params["adaptive_target"], params["adaptive_decay"]) == (0.2, 0.8)
        bad = httpx.post(
            f"{server.url}/completion", json={**body, "adaptive_target": 2.0}, timeout=30
        )
        assert bad.status_code == 400 and "adaptive_target" in bad.json()["error"]["message"]
    finally:
        server.stop()
