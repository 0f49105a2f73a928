"""llama-server's `post_sampling_probs` on native /completion, against a real server.

With `n_probs: N` and `post_sampling_probs: true`, every `completion_probabilities` entry
carries `prob` and `top_probs`: the probabilities of the distribution the token was drawn
from, after the whole sampler chain (top-k, top-p, min-p, temperature...), never a token
the chain removed. Seeded and `cache_prompt: false`, so a request samples the same tokens
with the flag on or off and the two answers can be compared.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
import test_server_native
from server_harness import serve
from sse_reader import sse_stream_json
from test_batched_sampling import MIXED, V
from test_server_openai import AUTH, main_server_args

from mlxcel.engine.sampling.batched import BatchSampler, RowSampling
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.samplers import make_distribution, post_sampling_of

server = test_server_native.server  # the shared tiny-model server and its client
http = test_server_native.http

PROMPT = "Today was the day. Today I would finally become a"


def body(**extra: Any) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "n_predict": 6,
        "n_probs": 10,
        "seed": 1234,
        "cache_prompt": False,
        "ignore_eos": True,
        "post_sampling_probs": True,
        **extra,
    }


def complete(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    response = http.post("/completion", json=body(**extra))
    assert response.status_code == 200, response.text
    return response.json()


def check_entry(entry: dict[str, Any], n: int) -> None:
    """One post-sampling entry: llama-server's keys, probabilities in (0, 1], most probable
    first, at most `n`, the drawn token among them when they are the whole truncated set."""
    assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
    assert isinstance(entry["token"], str) and isinstance(entry["bytes"], list)
    assert 0.0 < entry["prob"] <= 1.0
    top = entry["top_probs"]
    assert 1 <= len(top) <= n
    for item in top:
        assert set(item) == {"id", "token", "bytes", "prob"}
        assert 0.0 < item["prob"] <= 1.0
    probs = [item["prob"] for item in top]
    assert probs == sorted(probs, reverse=True)
    listed = {item["id"]: item["prob"] for item in top}
    if len(top) < n:  # the whole truncated distribution: it sums to 1, the draw is in it
        assert sum(probs) == pytest.approx(1.0, abs=1e-4)
        assert entry["id"] in listed
    if entry["id"] in listed:
        assert listed[entry["id"]] == pytest.approx(entry["prob"])
    else:  # not listed: no more probable than the least probable listed
        assert entry["prob"] <= probs[-1] + 1e-6
    assert sum(probs) <= 1.0 + 1e-4


def test_probabilities_after_the_sampler_chain(http: httpx.Client) -> None:
    result = complete(http, temperature=1.0, return_tokens=True)
    entries = result["completion_probabilities"]
    assert len(entries) == 6
    assert [e["id"] for e in entries] == result["tokens"]
    for entry in entries:
        check_entry(entry, 10)
    assert result["generation_settings"]["post_sampling_probs"] is True
    assert result["generation_settings"]["n_probs"] == 10


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_top_k_probabilities_are_the_renormalized_candidates(
    http: httpx.Client, temperature: float
) -> None:
    """top_k 3 (top-p and min-p off): the three candidates' model probabilities, raised to
    1/temperature and renormalized; the same seeded draw with the flag off gives them."""
    knobs = {"temperature": temperature, "top_k": 3, "top_p": 1.0, "min_p": 0.0, "n_probs": 5}
    post = complete(http, **knobs)["completion_probabilities"]
    raw = complete(http, **knobs, post_sampling_probs=False)["completion_probabilities"]
    assert [e["id"] for e in post] == [e["id"] for e in raw]
    for p, r in zip(post, raw, strict=True):
        check_entry(p, 5)
        assert len(p["top_probs"]) == 3
        assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0, abs=1e-4)
        assert p["id"] in {t["id"] for t in p["top_probs"]}
        weights = {t["id"]: math.exp(t["logprob"] / temperature) for t in r["top_logprobs"][:3]}
        total = sum(weights.values())
        assert [t["id"] for t in p["top_probs"]] == list(weights)
        for t in p["top_probs"]:
            assert t["prob"] == pytest.approx(weights[t["id"]] / total, abs=2e-3)
        assert p["prob"] == pytest.approx(weights[p["id"]] / total, abs=2e-3)


def test_truncation_drops_tokens(http: httpx.Client) -> None:
    """A tight min-p keeps fewer than n_probs candidates: those that are left sum to 1."""
    entries = complete(http, temperature=1.0, min_p=0.9, top_k=0)["completion_probabilities"]
    for entry in entries:
        check_entry(entry, 10)
        assert len(entry["top_probs"]) < 10


def test_greedy_is_certain(http: httpx.Client) -> None:
    """temperature 0: the chosen token has all the mass, as llama-server reports."""
    greedy = complete(http, temperature=0)
    plain = complete(http, temperature=0, post_sampling_probs=False)
    assert greedy["content"] == plain["content"]
    for entry, raw in zip(
        greedy["completion_probabilities"], plain["completion_probabilities"], strict=True
    ):
        assert entry["id"] == raw["id"] == raw["top_logprobs"][0]["id"]
        assert entry["prob"] == 1.0
        assert [(t["id"], t["prob"]) for t in entry["top_probs"]] == [(entry["id"], 1.0)]


def test_flag_off_is_unchanged(http: httpx.Client) -> None:
    for flag in (False, None, "absent"):  # null is unset, as llama-server reads it
        payload = body(temperature=1.0, post_sampling_probs=flag)
        if flag == "absent":
            del payload["post_sampling_probs"]
        result = http.post("/completion", json=payload).json()
        assert result["generation_settings"]["post_sampling_probs"] is False
        for entry in result["completion_probabilities"]:
            assert set(entry) == {"id", "token", "bytes", "logprob", "top_logprobs"}
            assert entry["logprob"] <= 0.0
            assert len(entry["top_logprobs"]) == 10  # the model's, nothing truncated


def test_without_n_probs_nothing_is_reported(http: httpx.Client) -> None:
    """No `n_probs`: no probabilities; the settings echo the flag as asked (llama-server)."""
    result = complete(http, n_probs=0, temperature=1.0)
    assert "completion_probabilities" not in result
    assert result["generation_settings"]["post_sampling_probs"] is True


def test_stream_chunks_carry_probabilities(http: httpx.Client) -> None:
    response = http.post("/completion", json=body(temperature=1.0, top_k=3, stream=True))
    assert response.status_code == 200
    events = sse_stream_json(response, done=False)
    chunks = [e for e in events if not e["stop"] and e.get("tokens")]
    assert len(chunks) == 6
    for chunk in chunks:
        (entry,) = chunk["completion_probabilities"]
        check_entry(entry, 10)
        assert entry["id"] == chunk["tokens"][0]
        assert len(entry["top_probs"]) <= 3
    assert events[-1]["generation_settings"]["post_sampling_probs"] is True


@pytest.mark.parametrize("value", ["x", "true", 1, [True]])
def test_bad_type_is_400(http: httpx.Client, value: Any) -> None:
    response = http.post("/completion", json=body(post_sampling_probs=value))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "post_sampling_probs" in error["message"]


def test_backend_sampling_is_accepted(http: httpx.Client) -> None:
    """llama.cpp's `backend_sampling` (where it samples) changes nothing here."""
    on = complete(http, temperature=1.0, backend_sampling=True)
    off = complete(http, temperature=1.0, backend_sampling=False)
    assert on["completion_probabilities"] == off["completion_probabilities"]
    assert http.post("/completion", json=body(backend_sampling="x")).status_code == 400


def test_openai_routes_keep_the_openai_shape(http: httpx.Client) -> None:
    """/v1 routes answer log-probabilities in OpenAI's shape whatever the flag says."""
    common = {"max_tokens": 3, "temperature": 1.0, "seed": 5, "post_sampling_probs": True}
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
              "top_logprobs": 3, **common},
    )  # fmt: skip
    assert chat.status_code == 200, chat.text
    for entry in chat.json()["choices"][0]["logprobs"]["content"]:
        assert "logprob" in entry and "prob" not in entry and len(entry["top_logprobs"]) == 3
    text = http.post("/v1/completions", json={"prompt": PROMPT, "logprobs": 3, **common})
    assert text.status_code == 200, text.text
    logprobs = text.json()["choices"][0]["logprobs"]
    assert "top_probs" not in logprobs and len(logprobs["top_logprobs"][0]) == 3


def test_concurrent_rows_keep_their_own_distributions(http: httpx.Client) -> None:
    """Rows of one decode batch with different settings (and some without the flag) each
    get the distribution of their own draw."""
    cases: list[dict[str, Any]] = [
        {"prompt": "Once upon a time", "temperature": 1.0, "top_k": 3, "n_probs": 3},
        {"prompt": "The capital of", "temperature": 0.7, "top_k": 2, "n_probs": 4},
        {"prompt": "def f(x):", "temperature": 0},
        {"prompt": "Hello there", "temperature": 1.0, "post_sampling_probs": False},
        {"prompt": "In the beginning", "temperature": 1.0, "top_k": 0, "min_p": 0.5},
    ]
    payloads = [body(n_predict=12, **case) for case in cases]
    with ThreadPoolExecutor(len(payloads)) as pool:
        results = list(pool.map(lambda p: http.post("/completion", json=p), payloads))
    for payload, response in zip(payloads, results, strict=True):
        assert response.status_code == 200
        entries = response.json()["completion_probabilities"]
        assert len(entries) == 12
        for entry in entries:
            if not payload["post_sampling_probs"]:
                assert "top_logprobs" in entry
                continue
            check_entry(entry, payload["n_probs"])
            if payload["temperature"] == 0:
                assert entry["prob"] == 1.0
            if payload.get("top_k", 0) > 0:
                assert len(entry["top_probs"]) <= payload["top_k"]
                assert entry["id"] in {t["id"] for t in entry["top_probs"]}


def test_unbatched_sampling_reports_the_same(http: httpx.Client, tiny_llama_dir: Path) -> None:
    """Per-request samplers (no batch sampler) report the same draws and distributions,
    computed again from the step's log-probabilities."""
    knobs = {"temperature": 0.9, "top_k": 5, "top_p": 0.9}
    batched = complete(http, **knobs)["completion_probabilities"]
    env = {"MLXCEL_BATCHED_SAMPLING": "0"}
    with (
        serve(main_server_args(tiny_llama_dir), env=env) as other,
        other.client(headers=AUTH) as client,
    ):
        alone = complete(client, **knobs)["completion_probabilities"]
        greedy = complete(client, temperature=0)["completion_probabilities"]
    assert [e["id"] for e in alone] == [e["id"] for e in batched]
    for a, b in zip(alone, batched, strict=True):
        check_entry(a, 10)
        assert a["prob"] == pytest.approx(b["prob"], abs=1e-3)
        assert [t["id"] for t in a["top_probs"]] == [t["id"] for t in b["top_probs"]]
        for x, y in zip(a["top_probs"], b["top_probs"], strict=True):
            assert x["prob"] == pytest.approx(y["prob"], abs=1e-3)
    assert all(e["prob"] == 1.0 and len(e["top_probs"]) == 1 for e in greedy)


# ---------------------------------------------------------------- the batch sampler

# The batched-sampling suite's mixed rows but a coin-flipping XTC (a coin only the draw
# knows), plus XTC on top-k candidates (their order no longer most probable first).
ROWS = (
    # Mirostat's and adaptive-p's distributions move with their state: tested in
    # test_sampling_llama_samplers.py.
    *(
        p
        for p in MIXED
        if p.xtc_probability in (0.0, 1.0) and not p.mirostat and p.adaptive_target < 0
    ),
    SamplingParams(temperature=1.1, seed=8, top_k=10, min_p=0.0, xtc_probability=1.0),
)


def _expected(params: SamplingParams, row: mx.array, n: int) -> list[tuple[int, float]]:
    """The top `n` of the sampler's whole distribution (`make_distribution`), finite only."""
    dist = make_distribution(params)(row[None, :])[0]
    order = mx.argsort(-dist).tolist()[:n]  # type: ignore[index]
    values: list[float] = dist.tolist()  # type: ignore[assignment]
    return [(i, values[i]) for i in order if values[i] != float("-inf")]  # type: ignore[index]


def test_batch_sampler_keeps_each_rows_distribution() -> None:
    """Every row asking for it gets its own draw's distribution, in one batched call per
    step; rows not asking keep nothing."""
    wants = [5, 3, None, 20, 1, 7, 4, 5, 9, 3, 4, 6]
    rows = [RowSampling(p, V, post_probs=n) for p, n in zip(ROWS, wants, strict=True)]
    sampler = BatchSampler()
    rng = np.random.default_rng(0)
    for _ in range(15):
        x = mx.array(rng.normal(scale=2.0, size=(len(rows), V)).astype(np.float32))
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        tokens = sampler.sample(rows, lp).tolist()
        for i, (row, n) in enumerate(zip(rows, wants, strict=True)):
            token = tokens[i]  # type: ignore[index]
            got = row.take_post(token)
            if n is None:
                assert got is None and not row.post
                continue
            assert got is not None
            chosen, top = got
            expected = _expected(row.params, lp[i], n)
            assert [t for t, _ in top] == [t for t, _ in expected]
            assert [v for _, v in top] == pytest.approx([v for _, v in expected], abs=1e-5)
            assert token in {t for t, _ in expected} or chosen <= expected[-1][1] + 1e-6
            again_chosen, again = post_sampling_of(row.params, lp[i], token, n)
            assert again_chosen == pytest.approx(chosen, abs=1e-5)
            assert [t for t, _ in again] == [t for t, _ in top]
            assert [v for _, v in again] == pytest.approx([v for _, v in top], abs=1e-5)
            if row.params.temperature <= 0:
                assert got == (0.0, ((token, 0.0),))


def test_a_draw_that_is_not_the_reported_token_is_dropped() -> None:
    row = RowSampling(SamplingParams(temperature=1.0, seed=3), V, post_probs=3)
    sampler = BatchSampler()
    x = mx.array(np.random.default_rng(1).normal(size=(1, V)).astype(np.float32))
    token = int(sampler.sample([row], x - mx.logsumexp(x, axis=-1, keepdims=True)).item())
    assert row.take_post((token + 1) % V) is None
    assert not row.post


def test_vision_model_reports_the_same_shape(tmp_path: Path) -> None:
    """A vision model's engine (its own decode loop) reports post-sampling probabilities too."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    model = build_tiny_qwen2_vl(tmp_path / "qwen2vl")
    env = {"HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}
    args = ["-m", str(model), "-c", "2048"]
    with serve(args, env=env) as vlm, vlm.client() as client:
        result = complete(client, temperature=1.0, top_k=3, n_predict=4)
        greedy = complete(client, temperature=0, n_predict=4)
    entries = result["completion_probabilities"]
    assert len(entries) == 4
    for entry in entries:
        check_entry(entry, 10)
        assert len(entry["top_probs"]) <= 3
        assert entry["id"] in {t["id"] for t in entry["top_probs"]}
    assert all(e["prob"] == 1.0 for e in greedy["completion_probabilities"])
