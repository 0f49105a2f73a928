"""`mlxcel serve` checks the model before it opens the port: no announced port disappears."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.tiny_encoders import build_tiny_bert


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", *args, "--host", "127.0.0.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("kind", ["missing", "not-gguf", "truncated-header", "no-config"])
def test_a_bad_model_exits_2_without_announcing_a_port(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "model.gguf"
    if kind == "not-gguf":
        target.write_bytes(b"not a model at all")
    elif kind == "truncated-header":
        target.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05")
    elif kind == "no-config":
        target = tmp_path / "empty-dir"
        target.mkdir()
    result = _serve("-m", str(target), "--no-warmup")
    assert result.returncode == 2, result.stderr
    assert "listening" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error:"), lines
    assert "Traceback" not in result.stderr


def test_a_good_model_still_answers_loading_then_ok(tiny_llama_dir: Path) -> None:
    from server_harness import ServeProcess

    with ServeProcess(["-m", str(tiny_llama_dir), "--no-warmup"]) as server:
        assert "mlxcel: listening on http://127.0.0.1:" in server.stderr
        with server.client() as client:
            assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "case",
    [
        "reranking-decoder",
        "pooling-rank-decoder",
        "embedding-model",
        "reranker-model",
        "audio-model",
        "tts-model",
        "image-model",
        "draft-model",
        "encoder-as-chat-model",
    ],
)
def test_a_bad_side_model_or_kind_exits_2_before_listening(
    tiny_gguf: Path, tmp_path: Path, case: str
) -> None:
    """Every model flag is checked before the port opens, whatever else is given: a decoder
    without single yes/no tokens cannot rank (`--reranking`, as llama-server's rank pooling
    needs a classification head), and a missing or wrong-kind side model names its flag."""
    missing = str(tmp_path / "missing")
    not_whisper = tmp_path / "not-whisper"
    not_whisper.mkdir()
    main = ["-m", str(tiny_gguf)]
    args, flag = {
        "reranking-decoder": ([*main, "--reranking"], "--reranking"),
        "pooling-rank-decoder": ([*main, "--pooling", "rank"], "--pooling rank"),
        "embedding-model": ([*main, "--embedding-model", missing], "--embedding-model"),
        "reranker-model": (["--reranker-model", missing], "--reranker-model"),
        "audio-model": (["--embedding-model", "default", "--audio-model", str(not_whisper)],
                        "--audio-model"),
        "tts-model": ([*main, "--tts-model", missing], "--tts-model"),
        "image-model": (["--image-model", missing], "--image-model"),
        "draft-model": ([*main, "--spec-draft-model", missing], "--spec-draft-model"),
        "encoder-as-chat-model": (["-m", str(build_tiny_bert(tmp_path / "bert"))], "-m"),
    }[case]  # fmt: skip
    result = _serve(*args, "--no-warmup")
    assert result.returncode == 2, result.stderr
    assert "listening" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mlxcel: error: {flag}: "), lines
    if case == "encoder-as-chat-model":
        assert "an encoder model" in lines[0] and "--embedding" in lines[0]
    if "decoder" in case:
        assert "no single 'yes'/'no' tokens" in lines[0] and "cross-encoder" in lines[0]
