"""Batched sampling: one `BatchSampler` for the whole decode batch, per-row settings.

What must hold: each row samples exactly what its own `make_sampler` closure would on the
same log-probabilities (so seeded requests are reproducible whatever shares the batch, and
greedy rows are their argmax), the engine samples a mixed batch in one call per step, and
its output is the same with batched sampling on and off.
"""

from __future__ import annotations

import copy
import math
import queue
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine.sampling.batched import BatchRowsError, BatchSampler, RowSampling
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.samplers import make_sampler
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest

V = 96

MIXED = (
    SamplingParams(temperature=0.7, seed=1),  # defaults: top-k 40, top-p 0.95, min-p 0.05
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3, seed=2, top_k=0, top_p=0.9),
    SamplingParams(temperature=1.0, seed=3, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(
        temperature=1.1, seed=4, top_k=10, min_p=0.0, xtc_probability=0.5, xtc_threshold=0.05
    ),
    SamplingParams(temperature=0.9, seed=5, top_p=0.5, p_less=True),
    SamplingParams(temperature=1.5, seed=6, top_k=200),  # k >= vocabulary: off
    SamplingParams(temperature=0.8, seed=7, xtc_probability=1.0, xtc_threshold=0.02),
    SamplingParams(temperature=1.0, seed=8, top_n_sigma=1.0),  # with the default top-k
    SamplingParams(temperature=1.2, seed=9, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.6),
    SamplingParams(temperature=0.9, seed=10, typical_p=0.8, dynatemp_range=0.5),
    SamplingParams(
        temperature=0.5, seed=11, top_k=0, top_p=0.9, dynatemp_range=0.8, dynatemp_exponent=2.0
    ),
    SamplingParams(temperature=0.8, seed=12, mirostat=2, mirostat_tau=3.0),
    SamplingParams(temperature=1.0, seed=13, mirostat=1, mirostat_tau=4.0, mirostat_eta=0.2),
    SamplingParams(temperature=1.0, seed=14, adaptive_target=0.3),
    SamplingParams(
        temperature=0.7, seed=15, top_k=0, top_p=0.9, adaptive_target=0.6, adaptive_decay=0.5
    ),
)


def _logprobs(rng: np.random.Generator, rows: int) -> mx.array:
    x = mx.array(rng.normal(scale=2.0, size=(rows, V)).astype(np.float32))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_each_row_samples_as_its_own_closure() -> None:
    closures = [make_sampler(p) for p in MIXED]
    rows = [RowSampling(p, V) for p in MIXED]
    sampler = BatchSampler()
    rng = np.random.default_rng(0)
    for _ in range(25):
        lp = _logprobs(rng, len(MIXED))
        alone = [int(c(lp[i : i + 1]).item()) for i, c in enumerate(closures)]
        assert sampler.sample(rows, lp).tolist() == alone


# What `MIXED` drew before the two chains (per request, batched) became one (issue 29): the
# same seeds and log-probabilities must keep drawing exactly these tokens.
PINNED = [
    [22, 54, 36, 39, 51, 64, 56, 94, 36, 85, 17, 13, 5, 80, 72, 24],
    [73, 26, 35, 80, 3, 22, 72, 6, 46, 80, 68, 66, 60, 42, 74, 90],
    [52, 11, 16, 29, 95, 7, 76, 37, 51, 11, 56, 27, 66, 56, 59, 33],
    [32, 15, 66, 25, 77, 80, 17, 22, 52, 38, 27, 32, 59, 89, 26, 47],
    [63, 38, 82, 85, 31, 10, 23, 4, 31, 8, 65, 67, 84, 30, 89, 8],
    [36, 17, 52, 59, 61, 79, 91, 95, 92, 32, 56, 60, 72, 42, 59, 1],
]


def test_seeded_draws_are_the_pinned_ones_alone_and_batched() -> None:
    rng = np.random.default_rng(29)
    closures = [make_sampler(p) for p in MIXED]
    rows = [RowSampling(p, V) for p in MIXED]
    sampler = BatchSampler()
    for expected in PINNED:
        lp = _logprobs(rng, len(MIXED))
        assert [int(c(lp[i : i + 1]).item()) for i, c in enumerate(closures)] == expected
        assert sampler.sample(rows, lp).tolist() == expected


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch() -> None:
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    rng = np.random.default_rng(1)
    steps = [_logprobs(rng, 1) for _ in range(30)]

    def run(companions: tuple[SamplingParams, ...]) -> list[int]:
        sampler = BatchSampler()
        mine = RowSampling(params, V)
        others = [RowSampling(p, V) for p in companions]
        out = []
        for i, lp in enumerate(steps):
            # Companions come and go; the seeded row moves between batch positions.
            present = others[: i % (len(others) + 1)]
            batch = [*present, mine]
            rows = mx.concatenate([_logprobs(rng, len(present)), lp]) if present else lp
            tokens = sampler.sample(batch, rows)
            out.append(int(tokens[-1].item()))
        return out

    alone = run(())
    assert len(set(alone)) > 3  # it really samples
    assert run(MIXED) == alone
    assert run(MIXED[::-1]) == alone


def test_greedy_rows_are_their_argmax() -> None:
    rows = [RowSampling(p, V) for p in MIXED]
    lp = _logprobs(np.random.default_rng(2), len(MIXED))
    tokens = BatchSampler().sample(rows, lp)
    assert tokens.dtype == mx.uint32 and tokens.shape == (len(MIXED),)
    assert int(tokens[1].item()) == int(mx.argmax(lp[1]).item())
    all_greedy = [RowSampling(SamplingParams(temperature=0.0), V) for _ in range(3)]
    assert BatchSampler().sample(all_greedy, lp[:3]).tolist() == mx.argmax(lp[:3], -1).tolist()


def test_the_sampler_refuses_a_batch_it_was_not_told_about() -> None:
    sampler = BatchSampler()
    rows = [RowSampling(p, V) for p in MIXED[:3]]
    lp = _logprobs(np.random.default_rng(3), 3)
    with pytest.raises(BatchRowsError, match="no rows queued"):
        sampler(lp)
    sampler.expect(rows[:2])
    with pytest.raises(BatchRowsError, match="expected 2 rows and got 3"):
        sampler(lp)
    sampler.expect(rows)
    assert sampler.pending == 1
    assert sampler(lp).shape == (3,)
    assert sampler.pending == 0
    token, row = sampler.last_choice(rows[1])  # type: ignore[misc]
    assert int(token.item()) == int(mx.argmax(lp[1]).item())
    assert mx.array_equal(row, lp[1])


# -- in the engine -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


def _requests(loaded: Any) -> list[GenerationRequest]:
    texts = ["the morning train", "a river to the sea", "count the boxes", "the garden"]
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.6, seed=11),
        SamplingParams(temperature=1.2, seed=12, top_k=5),
        SamplingParams(temperature=1.0, seed=13, top_k=0, top_p=0.8),
        SamplingParams(temperature=0.9, seed=14, repetition_penalty=1.3),  # a processor too
        SamplingParams(temperature=0.0, seed=15),
    ]
    return [
        GenerationRequest(
            prompt_tokens=loaded.tokenizer.encode(texts[i % len(texts)] * (1 + i)),
            max_tokens=12 + 3 * i,  # they finish at different steps
            sampling=s,
            ignore_eos=True,
            cache_prompt=False,
            request_id=f"r{i}",
        )
        for i, s in enumerate(settings)
    ]


def _run_together(loaded: Any, requests: list[GenerationRequest], **kw: Any) -> dict[str, Any]:
    from mlxcel.engine.text.scheduler import TextEngine

    engine = TextEngine(loaded, slots=4, context_per_slot=512, prefill_chunk=16, **kw)
    sinks: dict[str, queue.SimpleQueue[GenerationEvent]] = {}
    try:
        for request in requests:  # six requests on four slots: some wait and join later
            sinks[request.request_id] = queue.SimpleQueue()
            engine.submit(copy.deepcopy(request), sinks[request.request_id].put)
        out = {}
        for request_id, sink in sinks.items():
            tokens: list[int] = []
            while not (event := sink.get(timeout=120)).finished:
                tokens.extend(event.token_ids)
            assert event.finish_reason == "length", event.error
            out[request_id] = tokens
        return out
    finally:
        engine.stop()


def test_engine_output_is_the_same_batched_or_per_request(
    tiny_loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = _requests(tiny_loaded)
    sizes: list[int] = []
    sample = BatchSampler.sample

    def spy(self: BatchSampler, rows: Any, logprobs: mx.array) -> mx.array:
        sizes.append(len(rows))
        return sample(self, rows, logprobs)

    monkeypatch.setattr(BatchSampler, "sample", spy)
    batched = _run_together(tiny_loaded, requests, batched_sampling=True)
    assert max(sizes) == 4  # a mixed batch of four sampled in one call
    calls = len(sizes)
    per_request = _run_together(tiny_loaded, requests, batched_sampling=False)
    # The per-request path runs the same chain on each request's own row, one row a call.
    assert len(sizes) > calls and set(sizes[calls:]) == {1}
    assert batched == per_request
    for request in requests:
        assert len(batched[request.request_id]) == request.max_tokens


def test_a_request_alone_matches_its_batched_run(tiny_loaded: Any) -> None:
    requests = _requests(tiny_loaded)
    together = _run_together(tiny_loaded, requests)
    for request in (requests[0], requests[1], requests[5]):  # greedy, seeded, greedy
        alone = _run_together(tiny_loaded, [replace(request)])
        assert alone[request.request_id] == together[request.request_id]


def test_a_folded_logit_bias_bans_and_boosts() -> None:
    rng = np.random.default_rng(4)
    lp = _logprobs(rng, 3)
    best = mx.argmax(lp, axis=-1).tolist()
    bias = ((best[0], -math.inf), (best[1], -math.inf), (5, 100.0))
    params = [
        SamplingParams(temperature=0.0, logit_bias=bias[:1]),
        SamplingParams(
            temperature=1.0, seed=1, top_k=0, top_p=1.0, min_p=0.0, logit_bias=bias[1:2]
        ),
        SamplingParams(temperature=0.7, seed=2, logit_bias=bias[2:]),
    ]
    rows = [RowSampling(p, V, logit_bias=True) for p in params]
    sampler = BatchSampler()
    draws = [sampler.sample(rows, lp).tolist() for _ in range(40)]
    biased = np.array(lp[0])
    biased[best[0]] = -np.inf
    assert all(d[0] == int(np.argmax(biased)) for d in draws)  # greedy, the argmax left
    assert all(d[1] != best[1] for d in draws) and len({d[1] for d in draws}) > 5
    assert all(d[2] == 5 for d in draws)  # +100 wins every draw
    unfolded = RowSampling(params[0], V)  # without logit_bias=True the bias is not applied
    assert BatchSampler().sample([unfolded], lp[:1]).tolist() == [best[0]]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        RowSampling(SamplingParams(logit_bias=((V, 1.0),)), V, logit_bias=True)


def test_engine_folds_a_lone_logit_bias_into_the_batch_sampler(
    tiny_loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.engine.text.decode_batch import DecodeBatch

    requests = _requests(tiny_loaded)[:5]
    base = _run_together(tiny_loaded, requests)
    banned = sorted({t for tokens in base.values() for t in tokens[:4]})
    bias = tuple((t, -math.inf) for t in banned)
    biased = [replace(r, sampling=replace(r.sampling, logit_bias=bias)) for r in requests]
    biased[1] = replace(biased[1], logprobs=0)  # reports log-probabilities: not folded
    processors: list[int] = []
    insert = DecodeBatch.insert

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        processors.extend(len(p) for p in kw["logits_processors"])
        return insert(self, *args, **kw)

    monkeypatch.setattr(DecodeBatch, "insert", spy)
    out = _run_together(tiny_loaded, biased)
    assert processors == [0, 1, 0, 0, 2]  # the fifth also has a repetition penalty
    for tokens in out.values():
        assert not set(tokens) & set(banned)
    per_request = _run_together(tiny_loaded, biased, batched_sampling=False)
    assert out[biased[0].request_id] == per_request[biased[0].request_id]  # greedy
