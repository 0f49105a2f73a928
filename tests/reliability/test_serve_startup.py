"""`mlxcel serve` checks the model before it opens the port: no announced port disappears."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


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
