"""Embeddings, rerank and audio through a real `mlxcel serve` process (not an in-process app).

One server per mode: `--embedding` (embeddings only), a chat model with an embedding side
worker, and an audio-only server (`--audio-model` with no chat model).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from openai import OpenAI
from server_harness import serve

MINILM_PAIR = ("A man is eating food.", "A man is eating a piece of bread.")


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embedding_only_server_serves_minilm_and_refuses_chat() -> None:
    with serve(["--embedding"]) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        out = client.embeddings.create(model="minilm", input=list(MINILM_PAIR))
        assert len(out.data) == 2 and len(out.data[0].embedding) == 384
        assert abs(_cosine(out.data[0].embedding, out.data[1].embedding) - 0.7553) < 1e-3
        with server.client() as http:
            native = http.post("/embedding", json={"content": MINILM_PAIR[0]})
            assert native.status_code == 200
            body = native.json()
            assert isinstance(body, list) and "embedding" in body[0]
            health = http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert health.json()["model"] == "all-MiniLM-L6-v2"  # was "unknown"
            # the text model's routes: 501 naming what is served (were 500 AssertionError,
            # or 503 "loading model" for ever)
            messages = [{"role": "user", "content": "hi"}]
            for method, path, body in (
                ("POST", "/v1/chat/completions", {"messages": messages}),
                ("POST", "/v1/completions", {"prompt": "hi"}),
                ("POST", "/completion", {"prompt": "hi"}),
                ("POST", "/tokenize", {"content": "hi"}),
                ("POST", "/v1/responses", {"input": "hi"}),
                ("POST", "/v1/messages", {"model": "x", "max_tokens": 4, "messages": messages}),
                ("GET", "/props", None),
            ):
                answer = http.request(method, path, json=body)
                assert answer.status_code == 501, (path, answer.text)
                error = answer.json()["error"]
                # the spec's 501 for a route no model of this server handles (Anthropic's
                # route answers in Anthropic's shape)
                family_type = "api_error" if path == "/v1/messages" else "not_implemented"
                assert error["type"] == family_type, path
                assert "runs no chat model (it serves embeddings)" in error["message"], path
            assert http.get("/v1/models").json()["data"][0]["id"] == "all-MiniLM-L6-v2"


def test_chat_server_with_embedding_and_rerank_side_workers(tiny_llama_dir: Path) -> None:
    from mlxcel.engine.embeddings.loader import default_embedding_model_dir

    minilm = str(default_embedding_model_dir())
    args = ["-m", str(tiny_llama_dir), "--embedding-model", minilm, "--reranker-model", minilm]
    with serve(args) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        emb = client.embeddings.create(model="minilm", input="hello")
        assert len(emb.data[0].embedding) == 384
        with server.client() as http:
            ranked = http.post(
                "/v1/rerank",
                json={
                    "query": "What is the capital of France?",
                    "documents": ["Bananas are yellow.", "Paris is the capital of France."],
                    "top_n": 2,
                },
            )
            assert ranked.status_code == 200, ranked.text
            results = ranked.json()["results"]
            assert results[0]["index"] == 1
            tei = http.post("/rerank", json={"query": "capital of France", "texts": ["a", "b"]})
            assert tei.status_code == 200 and isinstance(tei.json(), list)


@pytest.mark.slow
def test_audio_only_server_transcribes_and_answers_501_on_chat() -> None:
    from fixtures.audio import SENTENCE, normalized_words, speech_wav

    wav = speech_wav()
    with serve(["--audio-model", "tiny.en"]) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        with wav.open("rb") as f:
            text = client.audio.transcriptions.create(model="whisper-1", file=f).text
        assert normalized_words(text) == normalized_words(SENTENCE)
        with server.client() as http:
            chat = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
            )
            assert chat.status_code == 501
            error = chat.json()["error"]
            assert error["type"] == "not_implemented"
            assert "/v1/audio/transcriptions" in error["message"]
