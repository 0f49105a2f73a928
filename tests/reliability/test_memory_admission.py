"""Request memory admission: the estimate, the budget, and the 503 through a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServeProcess
from sse_reader import DONE, sse_payloads

from mlxcel.engine.errors import RequestMemoryBudgetError
from mlxcel.engine.loading import load_model
from mlxcel.engine.text.memory_budget import (
    AdmissionControl,
    MemoryAdmission,
    configured_budget,
    estimate_request_bytes,
    model_shapes,
    parse_byte_size,
)

BUDGET = "400K"  # the tiny model: ~230 KB for a short request, ~650 KB for 600 tokens


def test_byte_sizes_parse_and_bad_ones_are_refused() -> None:
    assert parse_byte_size("12G") == 12 << 30
    assert parse_byte_size("512m") == 512 << 20
    assert parse_byte_size("1.5GiB") == 3 << 29
    assert parse_byte_size("4096") == 4096
    for bad in ("0", "none", "-1G", "12X", ""):
        with pytest.raises(ValueError, match="MLXCEL_REQUEST_MEMORY_BUDGET"):
            parse_byte_size(bad)
    assert configured_budget({}) is None
    assert configured_budget({"MLXCEL_REQUEST_MEMORY_BUDGET": "1M"}) == 1 << 20


def test_estimate_follows_the_model_shapes_and_the_context(tiny_llama_dir: Path) -> None:
    shapes = model_shapes(load_model(str(tiny_llama_dir)).model)
    # 2 layers x 2 KV heads x 16 dims x (K and V) x float32
    assert shapes.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    short = estimate_request_bytes(shapes, 10, 10, 512)
    long = estimate_request_bytes(shapes, 10, 2000, 512)
    assert short >= 256 * shapes.kv_bytes_per_token  # at least one KV step
    assert long - short >= (2048 - 256) * shapes.kv_bytes_per_token
    model = load_model(str(tiny_llama_dir)).model
    admission = MemoryAdmission(model, budget=parse_byte_size(BUDGET))
    assert admission.check(10, 10, 512) == short
    with pytest.raises(RequestMemoryBudgetError) as caught:
        admission.check(10, 2000, 512)
    assert caught.value.estimated_bytes == long
    assert caught.value.budget_bytes == parse_byte_size(BUDGET)


def test_an_engine_reads_its_model_shapes_once_and_keeps_them_while_it_sleeps(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXCEL_REQUEST_MEMORY_BUDGET", BUDGET)
    model = load_model(str(tiny_llama_dir)).model
    reads: list[object] = []

    def current() -> object:  # the engine's network: unloaded (None) after the first read
        reads.append(model)
        return model if len(reads) == 1 else None

    control = AdmissionControl(current)
    control.admit(10, 10, 512)
    first = control.admission()
    control.admit(10, 10)  # asleep: the kept shapes answer; no chunk: the whole prompt
    with pytest.raises(RequestMemoryBudgetError):
        control.admit(10, 2000, 512)
    assert control.admission() is first and len(reads) == 1
    assert first.budget <= parse_byte_size(BUDGET)
    vision = type("VisionLanguageModel", (), {"language_model": model})()
    assert AdmissionControl(lambda: vision).admission().shapes == first.shapes


@pytest.fixture(scope="module")
def budget_server(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    server = ServeProcess(
        # float32 KV: the figures above (the default f16 halves the KV cache)
        [
            "-m",
            str(tiny_llama_dir),
            "-np",
            "2",
            "-c",
            "4096",
            "--no-warmup",
            "-ctk",
            "f32",
            "-ctv",
            "f32",
        ],
        env={"MLXCEL_REQUEST_MEMORY_BUDGET": BUDGET},
    ).start()
    yield server
    server.stop()


def _chat(max_tokens: int, stream: bool) -> dict[str, object]:
    """Greedy: with the default sampling the random model draws its end token first about
    once in 40 requests, and the small request must produce tokens."""
    return {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,
    }


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("retry-after")
    error = response.json()["error"]
    assert error["type"] == error["code"] == "request_memory_budget_exceeded"
    assert error["budget_bytes"] == parse_byte_size(BUDGET)
    assert error["estimated_bytes"] > error["budget_bytes"]
    assert error["message"].startswith("request_memory_budget_exceeded: estimated_bytes=")


def test_a_request_over_the_budget_is_refused_and_a_small_one_runs(
    budget_server: ServeProcess,
) -> None:
    with budget_server.client() as client:
        _assert_refused(client.post("/v1/chat/completions", json=_chat(600, False)))
        _assert_refused(client.post("/completion", json={"prompt": "Hi", "n_predict": 600}))
        ok = client.post("/v1/chat/completions", json=_chat(4, False))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] >= 1
        assert client.get("/health").status_code == 200


def test_a_streamed_request_is_refused_before_any_sse_byte(budget_server: ServeProcess) -> None:
    with budget_server.client() as client:
        with client.stream("POST", "/v1/chat/completions", json=_chat(600, True)) as response:
            body = response.read()
            assert not body.startswith(b"data:")
            response._content = body
            _assert_refused(response)
        with client.stream("POST", "/v1/chat/completions", json=_chat(4, True)) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            payloads = sse_payloads(response.iter_lines())
        assert payloads[-1] == DONE
        assert json.loads(payloads[0])["object"] == "chat.completion.chunk"


def test_an_invalid_budget_refuses_to_start(tiny_llama_dir: Path) -> None:
    for bad in ("0", "none"):
        result = subprocess.run(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama_dir), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "MLXCEL_REQUEST_MEMORY_BUDGET": bad},
        )
        assert result.returncode == 2
        assert "listening" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "MLXCEL_REQUEST_MEMORY_BUDGET" in lines[0], lines


def test_a_vision_model_is_admitted_by_its_language_model(tmp_path: Path) -> None:
    """The vision engine (mlx-vlm) refuses a request over the budget too, before any work;
    its estimate comes from the language model's shapes, so it grows with the context."""
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    model = build_tiny_qwen2_vl(tmp_path / "qwen2vl")
    env = {"HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}
    env["MLXCEL_REQUEST_MEMORY_BUDGET"] = BUDGET
    server = ServeProcess(["-m", str(model), "-c", "2048", "--no-warmup"], env=env)
    with server, server.client() as client:
        _assert_refused(client.post("/v1/chat/completions", json=_chat(1000, False)))
        ok = client.post("/v1/chat/completions", json=_chat(4, False))
        assert ok.status_code == 200, ok.text
        assert client.get("/health").status_code == 200
