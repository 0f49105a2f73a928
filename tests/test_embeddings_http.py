"""Embedding and rerank routes: the openai SDK and httpx against an in-process app."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from fixtures.server_state import serve_side_models
from fixtures.tiny_encoders import GatedEmbedder, build_tiny_bert, build_tiny_cross_encoder

from mlxcel.config import Settings
from mlxcel.engine.embeddings import load_embedder, load_reranker, reranker_for
from mlxcel.engine.embeddings.rerank import sigmoid
from mlxcel.engine.workers import EmbeddingWorker
from mlxcel.server.embeddings.routes import router as embeddings_router
from mlxcel.server.embeddings.services import (
    EmbeddingServices,
    build_services,
    text_engine_wanted,
    wanted_models,
)
from mlxcel.server.embeddings.serving import EmbeddingService
from mlxcel.server.errors import install_error_handlers
from mlxcel.server.rerank.routes import router as rerank_router
from mlxcel.server.rerank.serving import RerankService

FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."
MAX_INPUTS = 4
RERANK_ROUTES = ["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"]


def make_app(services: EmbeddingServices) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(embeddings_router)
    app.include_router(rerank_router)
    serve_side_models(app, embeddings=services)
    return app


@pytest.fixture(scope="module")
def minilm_services() -> Iterator[EmbeddingServices]:
    embedder = load_embedder(None)
    worker = EmbeddingWorker(embedder=embedder, reranker=reranker_for(embedder)).start()
    services = EmbeddingServices(
        embeddings=EmbeddingService(worker, model_name="minilm", max_inputs=MAX_INPUTS),
        rerank=RerankService(worker, model_name="minilm", max_inputs=MAX_INPUTS),
        workers=[worker],
    )
    yield services
    services.stop()


@pytest.fixture(scope="module")
def client(minilm_services: EmbeddingServices) -> Iterator[TestClient]:
    with TestClient(make_app(minilm_services)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def cross_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """A rerank-only server on a tiny cross-encoder (raw scores are logits there)."""
    path = build_tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "ce")
    worker = EmbeddingWorker(reranker=load_reranker(str(path))).start()
    services = EmbeddingServices(rerank=RerankService(worker, model_name="tiny-ce"))
    services.workers.append(worker)
    with TestClient(make_app(services)) as test_client:
        yield test_client
    services.stop()


@pytest.fixture(scope="module")
def tiny_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Embeddings on a tiny BERT whose limit is 24 tokens (truncation is cheap there)."""
    path = build_tiny_bert(tmp_path_factory.mktemp("bert") / "bert")
    worker = EmbeddingWorker(embedder=load_embedder(str(path))).start()
    services = EmbeddingServices(embeddings=EmbeddingService(worker, model_name="tiny"))
    services.workers.append(worker)
    with TestClient(make_app(services)) as test_client:
        yield test_client
    services.stop()


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type"}
    return dict(body["error"])


# --------------------------------------------------------------------------- OpenAI


def test_openai_sdk_embeddings(client: TestClient) -> None:
    from openai import OpenAI

    sdk = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    result = sdk.embeddings.create(model="all-minilm", input=[FOOD, BREAD])  # SDK asks base64
    a, b = (np.array(d.embedding) for d in result.data)
    assert [d.index for d in result.data] == [0, 1]
    assert a.shape == (384,)
    assert abs(float(a @ b) - 0.7553) < 1e-3
    assert result.model == "all-minilm"
    assert result.usage.prompt_tokens == 19 and result.usage.total_tokens == 19

    floats = sdk.embeddings.create(model="m", input=FOOD, encoding_format="float")
    assert np.allclose(floats.data[0].embedding, a, atol=1e-6)

    short = sdk.embeddings.create(model="m", input=FOOD, dimensions=8, encoding_format="float")
    cut = np.array(short.data[0].embedding)
    assert cut.shape == (8,) and math.isclose(float(np.linalg.norm(cut)), 1.0, rel_tol=1e-5)
    assert np.allclose(cut, a[:8] / np.linalg.norm(a[:8]), atol=1e-6)


def test_openai_token_id_inputs(client: TestClient) -> None:
    ids = [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]  # "A man is eating food." in MiniLM
    text = client.post("/v1/embeddings", json={"input": FOOD}).json()["data"][0]["embedding"]
    one = client.post("/v1/embeddings", json={"input": ids}).json()
    many = client.post("/v1/embeddings", json={"input": [ids, ids[:4] + [102]]}).json()
    assert np.allclose(one["data"][0]["embedding"], text, atol=1e-6)
    assert len(many["data"]) == 2 and many["usage"]["prompt_tokens"] == 13
    bad = _error(client.post("/v1/embeddings", json={"input": [[1, 2, 99999]]}), 400)
    assert "outside the vocabulary" in bad["message"]


def test_openai_base64_is_little_endian_float32(client: TestClient) -> None:
    body = {"input": [FOOD], "encoding_format": "base64", "model": "x"}
    item = client.post("/v1/embeddings", json=body).json()["data"][0]
    floats = client.post("/v1/embeddings", json={"input": [FOOD]}).json()["data"][0]
    decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert item["object"] == "embedding" and item["index"] == 0
    assert np.array_equal(decoded, np.array(floats["embedding"], dtype=np.float32))


def test_openai_truncation_flag_and_refusal(tiny_client: TestClient) -> None:
    long = "cat " * 40
    cut = tiny_client.post("/v1/embeddings", json={"input": ["a cat", long], "truncate": True})
    assert "truncated" not in cut.json()["data"][0] and cut.json()["data"][1]["truncated"] is True
    assert cut.json()["usage"]["prompt_tokens"] == 4 + 24
    # by default refused, as OpenAI and llama-server refuse it ("too large")
    error = _error(tiny_client.post("/v1/embeddings", json={"input": ["a cat", long]}), 400)
    assert error["code"] == "context_length_exceeded"
    assert "input 1 has 42 tokens, more than the model's limit of 24" in error["message"]
    assert "too large" in error["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": ["a", []]}, "'input[1]' is an empty token list"),
        ({"input": [[1, "a", None]]}, "must be a string or a list of token ids"),
        ({"input": []}, "'input' is empty"),
        ({}, "'input' is required"),
        ({"input": ["a", "b", "c", "d", "e"]}, "5 items; at most 4"),
        ({"input": [["a"]]}, "must be a string or a list of token ids"),
        ({"input": {"text": "a"}}, "must be a string"),
        ({"input": "a", "dimensions": 385}, "dimensions must be between 1 and 384"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "embd_normalize": -3}, "embd_normalize"),
    ],
)
def test_openai_bad_requests(client: TestClient, body: dict[str, Any], needle: str) -> None:
    error = _error(client.post("/v1/embeddings", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]


# --------------------------------------------------------------------------- native


def test_native_embedding_shape(client: TestClient) -> None:
    one = client.post("/embedding", json={"content": FOOD}).json()
    assert isinstance(one, list) and len(one) == 1 and one[0]["index"] == 0
    (vector,) = one[0]["embedding"]  # llama-server wraps the pooled vector in a list
    assert len(vector) == 384
    two = client.post("/embeddings", json={"input": [FOOD, BREAD]}).json()
    assert [item["index"] for item in two] == [0, 1]
    a, b = (np.array(item["embedding"][0]) for item in two)
    assert np.allclose(a, vector, atol=1e-6) and abs(float(a @ b) - 0.7553) < 1e-3


def test_native_embd_normalize(client: TestClient) -> None:
    raw = client.post("/embedding", json={"content": FOOD, "embd_normalize": -1}).json()
    scaled = client.post("/embedding", json={"content": FOOD, "embd_normalize": 0}).json()
    vector = np.array(raw[0]["embedding"][0])
    assert not math.isclose(float(np.linalg.norm(vector)), 1.0, rel_tol=1e-3)
    assert math.isclose(float(np.abs(scaled[0]["embedding"][0]).max()), 32760.0, rel_tol=1e-6)


def test_native_errors_and_truncation(tiny_client: TestClient) -> None:
    assert "required" in _error(tiny_client.post("/embeddings", json={}), 400)["message"]
    long = "cat " * 40
    # llama-server refuses an over-long input on its own routes ("too large")
    refused = _error(tiny_client.post("/embedding", json={"content": long}), 400)
    assert refused["code"] == "context_length_exceeded"
    assert "too large" in refused["message"] and "42 tokens" in refused["message"]
    cut = tiny_client.post("/embedding", json={"content": [long, "a cat"], "truncate": True})
    assert cut.json()[0]["truncated"] is True and "truncated" not in cut.json()[1]


def test_native_empty_and_mixed_prompts_as_llama_server(tiny_client: TestClient) -> None:
    def vectors(content: object) -> list[np.ndarray]:
        response = tiny_client.post("/embeddings", json={"content": content})
        assert response.status_code == 200, response.text
        return [np.array(item["embedding"][0]) for item in response.json()]

    (empty,) = vectors("")  # [CLS] [SEP]: embedded, not refused
    assert empty.shape == (16,) and np.isfinite(empty).all()
    (text,) = vectors("a cat")
    cls_id, sep_id = 2, 3  # the tiny BERT vocabulary's [CLS] and [SEP]
    (mixed,) = vectors([cls_id, "a cat", sep_id])  # one prompt: ids with a text in place
    np.testing.assert_allclose(mixed, text, atol=1e-6)
    many = vectors([[cls_id, "a", sep_id], "a cat", [cls_id, 9, sep_id]])
    assert len(many) == 3
    np.testing.assert_allclose(many[1], text, atol=1e-6)
    openai = tiny_client.post("/v1/embeddings", json={"input": [cls_id, "a cat", sep_id]})
    assert len(openai.json()["data"]) == 1
    np.testing.assert_allclose(openai.json()["data"][0]["embedding"], text, atol=1e-6)


def test_pooling_none_on_native_and_openai(tmp_path: Path) -> None:
    embedder = load_embedder(None, pooling="none")
    worker = EmbeddingWorker(embedder=embedder).start()
    services = EmbeddingServices(embeddings=EmbeddingService(worker, model_name="m"))
    services.workers.append(worker)
    try:
        with TestClient(make_app(services)) as test_client:
            tokens = test_client.post("/embedding", json={"content": FOOD}).json()
            assert len(tokens[0]["embedding"]) == 8  # one vector per token
            assert all(len(row) == 384 for row in tokens[0]["embedding"])
            error = _error(test_client.post("/v1/embeddings", json={"input": FOOD}), 400)
            assert "not OAI compatible" in error["message"]
    finally:
        services.stop()


# --------------------------------------------------------------------------- rerank


DOCS = [
    "Stock markets fell sharply on Monday.",
    "Cats enjoy eating fish and chicken.",
    "The recipe calls for two cups of flour.",
    "My cat loves tuna for dinner.",
]
QUERY = "What food do cats like?"


def test_rerank_jina_cohere_ranks_minilm_honestly(client: TestClient) -> None:
    body = {"model": "r", "query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": True}
    payload = client.post("/v1/rerank", json=body).json()
    assert payload["model"] == "r" and payload["object"] == "list"
    results = payload["results"]
    assert len(results) == 2 and {r["index"] for r in results} == {1, 3}
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert results[0]["document"] == {"text": DOCS[results[0]["index"]]}
    assert payload["usage"]["prompt_tokens"] == payload["usage"]["total_tokens"] > 0


def test_rerank_tei_ranks_minilm_honestly(client: TestClient) -> None:
    payload = client.post("/rerank", json={"query": QUERY, "texts": DOCS}).json()
    assert isinstance(payload, list) and len(payload) == 4
    assert {item["index"] for item in payload[:2]} == {1, 3}
    assert all(set(item) == {"index", "score"} for item in payload)


def test_rerank_documents_as_objects_and_defaults(client: TestClient) -> None:
    docs = [{"text": d} for d in DOCS[:2]]
    payload = client.post("/v1/rerank", json={"query": QUERY, "documents": docs}).json()
    assert [r["index"] for r in payload["results"]] == [1, 0]
    assert all("document" not in r for r in payload["results"])  # return_documents is off
    assert payload["model"] == "minilm"


@pytest.mark.parametrize("kind", ["application/x-www-form-urlencoded", "text/plain", None])
def test_bodies_are_json_whatever_the_content_type(client: TestClient, kind: str | None) -> None:
    """`curl -d '{...}'` sends a urlencoded type; llama-server reads the body as JSON (it was
    a 400 'must be an object (got bytes)' here)."""
    headers = {"Content-Type": kind} if kind else {}
    rerank = {"query": QUERY, "documents": DOCS[:2]}
    for route, body in (("/v1/embeddings", {"input": "a cat"}), ("/v1/rerank", rerank)):
        answer = client.post(route, content=json.dumps(body), headers=headers)
        assert answer.status_code == 200, (route, answer.text)
        if route == "/v1/rerank":
            assert [r["index"] for r in answer.json()["results"]] == [1, 0]
        else:
            assert len(answer.json()["data"][0]["embedding"]) == 384
    bad = client.post("/v1/embeddings", content="input=a+cat", headers=headers)
    assert "not valid JSON" in _error(bad, 400)["message"]


TINY_DOCS = ["the cat eats fish", "stock market fell today", "a dog", "one two three"]


@pytest.mark.parametrize("route", RERANK_ROUTES)
def test_every_rerank_route_answers_both_shapes(cross_client: TestClient, route: str) -> None:
    jina = cross_client.post(
        route, json={"query": "cat food", "documents": TINY_DOCS, "top_n": 3}
    ).json()
    scores = [r["relevance_score"] for r in jina["results"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    tei = cross_client.post(
        route, json={"query": "cat food", "texts": TINY_DOCS, "return_text": True}
    ).json()
    assert [item["index"] for item in tei[:3]] == [r["index"] for r in jina["results"]]
    assert [item["score"] for item in tei[:3]] == scores
    assert all(item["text"] == TINY_DOCS[item["index"]] for item in tei)


def test_tei_raw_scores_are_logits_and_default_is_sigmoid(cross_client: TestClient) -> None:
    texts = ["the cat eats fish", "stock market fell today", "a dog"]
    default = cross_client.post("/rerank", json={"query": "cat food", "texts": texts}).json()
    raw = cross_client.post(
        "/rerank", json={"query": "cat food", "texts": texts, "raw_scores": True}
    ).json()
    raw_by_index = {item["index"]: item["score"] for item in raw}
    assert [i["index"] for i in default] == [i["index"] for i in raw]
    for item in default:
        assert math.isclose(item["score"], sigmoid(raw_by_index[item["index"]]), rel_tol=1e-6)
        assert 0.0 < item["score"] < 1.0
    jina = cross_client.post("/v1/rerank", json={"query": "cat food", "documents": texts}).json()
    assert jina["model"] == "tiny-ce"
    assert [r["relevance_score"] for r in jina["results"]] == [i["score"] for i in default]


def test_rerank_truncation_flag(cross_client: TestClient) -> None:
    long = "fish " * 60
    payload = cross_client.post(
        "/v1/rerank", json={"query": "cat food", "documents": [long, "a dog"]}
    ).json()
    flagged = {r["index"]: r.get("truncated", False) for r in payload["results"]}
    assert flagged == {0: True, 1: False}
    refused = cross_client.post(
        "/v1/rerank", json={"query": "cat food", "documents": [long], "truncate": False}
    )
    assert _error(refused, 400)["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"query": "q", "documents": []}, "'documents' is empty"),
        ({"query": "q"}, "'documents' (or 'texts') is required"),
        ({"query": "q", "documents": ["a"], "texts": ["a"]}, "not both"),
        ({"query": "", "documents": ["a"]}, "'query' is an empty string"),
        ({"query": "q", "texts": ["a", ""]}, "'texts[1]' is an empty string"),
        ({"query": "q", "documents": [1]}, "must be a string or an object with 'text'"),
        ({"query": "q", "documents": ["a"] * 5}, "5 items; at most 4"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"documents": ["a"]}, "query"),
    ],
)
def test_rerank_bad_requests(client: TestClient, body: dict[str, Any], needle: str) -> None:
    assert needle in _error(client.post("/v1/rerank", json=body), 400)["message"]


# --------------------------------------------------------------------------- not enabled


def test_routes_answer_501_when_not_enabled(cross_client: TestClient) -> None:
    error = _error(cross_client.post("/v1/embeddings", json={"input": "hi"}), 501)
    assert error["type"] == "not_supported_error"
    assert error["message"].startswith("This server has no embedding model.")
    assert "`--embedding-model MODEL`" in error["message"]
    _error(cross_client.post("/embedding", json={"content": "hi"}), 501)
    with TestClient(make_app(EmbeddingServices())) as bare:
        error = _error(bare.post("/v1/rerank", json={"query": "q", "documents": ["a"]}), 501)
        assert "Start it with `--reranker-model MODEL`" in error["message"]
    with TestClient(make_app(EmbeddingServices(loading=True))) as loading:
        answer = loading.post("/v1/embeddings", json={"input": "hi"})
        # the spec's one loading answer, as the audio and chat routes give it
        assert _error(answer, 503) == {
            "message": "Loading model",
            "type": "server_busy",
            "code": None,
        }
        assert answer.headers["retry-after"] == "1"


# --------------------------------------------------------------------------- admission


def _gated_app(queue_depth: int, timeout: float | None) -> tuple[FastAPI, GatedEmbedder, Any]:
    fake = GatedEmbedder()
    worker = EmbeddingWorker(embedder=fake, batch_size=8, queue_depth=queue_depth).start()
    service = EmbeddingService(worker, model_name="gated", timeout=timeout)
    services = EmbeddingServices(embeddings=service, workers=[worker])
    return make_app(services), fake, services


def test_full_queue_answers_503_server_busy() -> None:
    app, fake, services = _gated_app(queue_depth=1, timeout=None)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            first = asyncio.create_task(http.post("/v1/embeddings", json={"input": "abc"}))
            assert await asyncio.to_thread(fake.entered.wait, 10)  # the worker is busy
            second = asyncio.create_task(http.post("/embedding", json={"content": "abcd"}))
            await asyncio.sleep(0.1)  # the second request now holds the only queue place
            third = await http.post("/v1/embeddings", json={"input": "x"})
            fake.gate.set()
            return [await first, await second, third]

    try:
        first, second, third = asyncio.run(scenario())
    finally:
        fake.gate.set()
        services.stop()
    assert first.status_code == 200 and second.status_code == 200
    assert second.json()[0]["embedding"][0][0] == pytest.approx(4 / math.sqrt(17))
    error = _error(third, 503)
    assert error["type"] == "server_busy"
    assert third.headers["retry-after"] == "1"


def test_slow_request_answers_504() -> None:
    app, fake, services = _gated_app(queue_depth=4, timeout=0.3)
    try:
        with TestClient(app) as test_client:
            response = test_client.post("/v1/embeddings", json={"input": "abc"})
        error = _error(response, 504)
        assert error["type"] == "timeout_error"
        assert "timed out after 0.3 s" in error["message"]
    finally:
        fake.gate.set()
        services.stop()


# --------------------------------------------------------------------------- from settings


def test_wanted_models_follow_the_flags() -> None:
    assert wanted_models(Settings()) == (False, None, False, None)
    assert wanted_models(Settings(embedding=True, model="/m")) == (True, "/m", False, None)
    assert wanted_models(Settings(reranking=True)) == (False, None, True, None)
    assert wanted_models(Settings(pooling="rank", model="/r"))[2:] == (True, "/r")


def test_text_engine_runs_unless_the_main_model_is_taken(tmp_path: Path) -> None:
    encoder = str(build_tiny_cross_encoder(tmp_path / "ce"))
    assert text_engine_wanted(Settings())
    assert text_engine_wanted(Settings(reranking=True))  # MiniLM reranks next to the chat model
    assert not text_engine_wanted(Settings(embedding=True))  # embeddings only
    assert not text_engine_wanted(Settings(reranking=True, model=encoder))
    assert text_engine_wanted(Settings(model=encoder))  # not our call: the text loader decides


def test_build_services_shares_one_worker_for_one_encoder() -> None:
    services = build_services(Settings(embedding=True, reranking=True, embd_normalize=1))
    try:
        assert services.embeddings is not None and services.rerank is not None
        assert len(services.workers) == 1
        assert services.embeddings.model_name == "all-MiniLM-L6-v2"
        assert services.embeddings.normalize == 1
        with TestClient(make_app(services)) as test_client:
            data = test_client.post("/v1/embeddings", json={"input": FOOD}).json()["data"]
            assert math.isclose(float(np.abs(data[0]["embedding"]).sum()), 1.0, rel_tol=1e-5)
            ranked = test_client.post(
                "/rerank", json={"query": "bread", "texts": ["A cat sleeps.", BREAD]}
            ).json()
            assert ranked[0]["index"] == 1
    finally:
        services.stop()
    assert build_services(Settings()).workers == []
