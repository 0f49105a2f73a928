"""`mlxcel bench` and `mlxcel bench serve`: output shapes, options and errors (no timings)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import socket
from pathlib import Path

import httpx
import pytest
from mlxcel.commands import bench
from server_harness import API_KEY, main_server_args, shared_server
from typer.testing import CliRunner

from mlxcel.benchclient import (
    RequestResult,
    ServeBenchConfig,
    percentile,
    preflight,
    run_serve_bench,
    summarize_level,
)

runner = CliRunner()


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(bench.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_fails(args: list[str], needle: str) -> None:
    code, out, err = run(*args)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    assert needle in lines[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------ local bench


def test_json_shape_and_positive_numbers(tiny_llama_dir: Path) -> None:
    code, out, err = run("-m", str(tiny_llama_dir), "-p", "16", "-n", "4", "-r", "2", "--json")
    assert code == 0, err
    assert err == ""  # no spinner or progress off a terminal
    data = json.loads(out)
    model = data["model"]
    assert model["name"] == "tiny-llama" and model["architecture"] == "llama"
    assert model["size_bytes"] > 0 and model["n_params"] > 0
    assert model["backend"] in ("CPU", "Metal", "CUDA")
    if model["backend"] == "CPU":
        assert model["blas"]
    assert data["config"] == {
        "n_prompt": 16,
        "n_gen": 4,
        "repetitions": 2,
        "batch": [1],
        "prefill_chunk": 2048,
        "tg_prompt_tokens": 8,
    }
    assert "compare" not in data
    results = data["results"]
    assert [(r["engine"], r["test"], r["kind"], r["batch"]) for r in results] == [
        ("mlxcel", "pp16", "pp", 1),
        ("mlxcel", "tg4", "tg", 1),
    ]
    assert (results[0]["n_prompt"], results[0]["n_gen"]) == (16, 0)
    assert (results[1]["n_prompt"], results[1]["n_gen"]) == (8, 4)
    for r in results:
        assert len(r["samples"]) == 2 and all(s > 0 for s in r["samples"])
        assert r["tokens_per_second"] == pytest.approx(sum(r["samples"]) / 2)
        assert r["stddev"] >= 0
        assert r["peak_memory_bytes"] > 0


def test_csv_header_and_batch_rows(tiny_llama_dir: Path) -> None:
    args = ("-m", str(tiny_llama_dir), "-p", "16", "-n", "4", "-r", "1", "--batch", "1,2")
    code, out, err = run(*args, "--csv")
    assert code == 0, err
    rows = list(csv.reader(io.StringIO(out)))
    assert tuple(rows[0]) == bench.CSV_COLUMNS
    body = [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]
    assert [(r["test"], r["batch"]) for r in body] == [("pp16", "1"), ("tg4", "1"), ("tg4", "2")]
    for r in body:
        assert r["engine"] == "mlxcel" and r["model"] == "tiny-llama"
        assert r["architecture"] == "llama"
        assert float(r["tokens_per_second"]) > 0 and r["repetitions"] == "1"
        assert r["ratio_vs_mlx_lm"] == ""


def test_table_names_the_architecture_and_quantization(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A GGUF file's table row says what it is: its name, the architecture and the GGUF
    quantization, as `mlxcel cache list` and `/props` name them; CSV and JSON too."""
    from fixtures.tiny_models import write_tiny_gguf

    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    args = ("-m", str(gguf), "-p", "8", "-n", "2", "-r", "1")
    code, out, err = run(*args)
    assert code == 0, err
    row = next(line for line in out.splitlines() if "pp8" in line)
    assert re.search(r"\(llama\) Q8_0", row), row
    code, out, err = run(*args, "--json")
    assert code == 0, err
    model = json.loads(out)["model"]
    assert model["architecture"] == "llama" and model["quantization"].startswith("Q8_0")
    code, out, err = run(*args, "--csv")
    assert code == 0, err
    first = dict(zip(*list(csv.reader(io.StringIO(out)))[:2], strict=True))
    assert first["architecture"] == "llama" and first["quantization"].startswith("Q8_0")


def test_compare_mlx_lm_json_and_table(tiny_llama_dir: Path) -> None:
    base = ("-m", str(tiny_llama_dir), "-p", "16", "-n", "4", "-r", "1", "--compare", "mlx-lm")
    code, out, err = run(*base, "--batch", "1,2", "--json")
    assert code == 0, err
    data = json.loads(out)
    engines = [(r["engine"], r["test"], r["batch"]) for r in data["results"]]
    for key in [("pp16", 1), ("tg4", 1), ("tg4", 2)]:
        assert ("mlxcel", *key) in engines and ("mlx-lm", *key) in engines
    compare = {(c["test"], c["batch"]): c for c in data["compare"]}
    assert set(compare) == {("pp16", 1), ("tg4", 1), ("tg4", 2)}
    for c in compare.values():
        assert c["mlxcel"] > 0 and c["mlx_lm"] > 0
        assert c["ratio"] == pytest.approx(c["mlxcel"] / c["mlx_lm"])

    code, out, err = run(*base, "-n", "0")  # the last -n wins: the prefill test only
    assert code == 0, err
    assert "mlxcel / mlx-lm" in out
    assert re.search(r"pp16\s.*\d+\.\d\dx", out), out
    assert "tg4" not in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--json", "--csv"], "--json and --csv"),
        (["--compare", "vllm"], "only knows mlx-lm"),
        (["-n", "1"], "-n must be 0"),
        (["-p", "0", "-n", "0"], "nothing to measure"),
        (["-r", "0"], "-r must be >= 1"),
        (["--batch", "1,x"], "comma-separated integers"),
        (["--batch", "0"], "integers >= 1"),
        (["-m", "/no/such/model"], "/no/such/model"),
    ],
)
def test_local_errors_are_one_line(args: list[str], needle: str) -> None:
    assert_fails(args, needle)


def test_synthetic_prompt_has_exactly_the_asked_length(tiny_llama_dir: Path) -> None:
    from mlxcel.engine.bench import synthetic_prompt
    from mlxcel.engine.loading import load_model

    loaded = load_model(str(tiny_llama_dir))
    for n in (1, 16, 3000):  # 3000: past the tokenizer's own maximum length
        ids = synthetic_prompt(loaded, n)
        assert len(ids) == n and all(loaded.tokenizer.is_valid_id(i) for i in ids)
    assert synthetic_prompt(loaded, 5)[0] == loaded.tokenizer.bos_token_id


def test_prompt_longer_than_the_context_is_an_error(tiny_llama_dir: Path) -> None:
    assert_fails(["-m", str(tiny_llama_dir), "-p", "5000", "-n", "0"], "does not fit")


# ------------------------------------------------------------------------ bench serve


def test_serve_bench_against_mlxcel_serve(tiny_llama_dir: Path) -> None:
    server = shared_server(main_server_args(tiny_llama_dir))
    code, out, err = run(
        "serve", "--url", server.url, "--api-key", API_KEY, "--concurrency", "1,2",
        "--requests", "4", "--max-tokens", "4", "--prompt-len", "16", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["url"] == server.url and data["endpoint"] == "/v1/chat/completions"
    assert data["model"] == "tiny-llama" and data["timed_out"] is False
    assert data["world_size"] == 1  # /props: the model is whole in one process
    assert [level["concurrency"] for level in data["levels"]] == [1, 2]
    for level in data["levels"]:
        assert level["requests"] == 4 and level["completed"] == 4
        assert level["errors"] == 0 and level["http_503"] == 0, level["error_messages"]
        assert level["usage_reported"] is True
        assert 4 <= level["output_tokens"] <= 16
        assert level["tokens_per_second"] > 0 and level["wall_s"] > 0
        assert level["ttft_ms"]["p50"] > 0
        assert level["ttft_ms"]["p95"] >= level["ttft_ms"]["p50"]


def test_serve_bench_completions_table(tiny_llama_dir: Path) -> None:
    server = shared_server(main_server_args(tiny_llama_dir))
    code, out, err = run(
        "serve", "--url", server.url + "/v1/", "--api-key", API_KEY, "-c", "2", "-N", "2",
        "--max-tokens", "3", "--prompt-len", "8", "--endpoint", "completions",
    )  # fmt: skip
    assert code == 0, err
    assert "/v1/completions" in out and "TTFT p50 ms" in out
    assert re.search(r"^\s*2\s+│\s+2\s+│\s+2\s+│\s+0\s+│\s+0\s+│", out, re.M), out


def test_serve_bench_wrong_key_is_one_line(tiny_llama_dir: Path) -> None:
    server = shared_server(main_server_args(tiny_llama_dir))
    assert_fails(["serve", "--url", server.url, "--api-key", "wrong"], "check --api-key")


def test_serve_bench_nothing_listening_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert_fails(["serve", "--url", url, "-c", "1", "-N", "1"], f"cannot reach {url}")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--url", "localhost:8080"], "must start with http"),
        (["--url", "http://[::1"], "--url 'http://[::1' is not a valid URL: Invalid port"),
        (["--url", "http://x", "--concurrency", "0"], "integers >= 1"),
        (["--url", "http://x", "--requests", "0"], "--requests must be >= 1"),
        (["--url", "http://x", "--endpoint", "embeddings"], "chat or completions"),
    ],
)
def test_serve_bench_option_errors(args: list[str], needle: str) -> None:
    assert_fails(["serve", *args], needle)


# ------------------------------------------------------------- client against mock servers


def _sse(*chunks: object) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def test_client_counts_chunks_without_usage_and_503s() -> None:
    calls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]})
        if request.url.path == "/props":  # the key check: a server without the route
            return httpx.Response(404)
        calls["n"] += 1
        body = json.loads(request.content)
        assert body["stream"] is True and body["max_tokens"] == 5
        assert body["messages"][0]["content"].startswith("Request ")
        assert "model" not in body  # two models listed and no --model: none is sent
        if calls["n"] % 2 == 0:
            return httpx.Response(503, json={"error": {"message": "queue full"}})
        pieces = [{"choices": [{"delta": {"content": w}}]} for w in ("a", "b", "c")]
        return httpx.Response(200, content=_sse({"choices": [{"delta": {"role": "x"}}]}, *pieces))

    transport = httpx.MockTransport(handler)
    config = ServeBenchConfig(
        url="http://bench.test/v1", concurrency=(1,), requests=4, max_tokens=5, warmup=False
    )
    model = asyncio.run(preflight(config, transport=transport))
    assert model is None
    report = asyncio.run(run_serve_bench(config, model=model, transport=transport))
    (level,) = report.levels
    assert (level.completed, level.http_503, level.errors) == (2, 2, 0)
    assert level.output_tokens == 6 and level.usage_reported is False
    assert level.error_messages == ["HTTP 503: queue full"]
    assert level.itl_p50_ms is not None and level.ttft_p50_ms is not None


def test_client_uses_usage_and_the_only_model() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "only"}]})
        if request.url.path == "/props":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        assert body["model"] == "only" and "prompt" in body and body["ignore_eos"] is True
        usage = {"usage": {"prompt_tokens": 9, "completion_tokens": 7}, "choices": []}
        return httpx.Response(200, content=_sse({"choices": [{"text": "xyz"}]}, usage))

    transport = httpx.MockTransport(handler)
    config = ServeBenchConfig(
        url="http://bench.test", concurrency=(2, 3), requests=3, endpoint="completions",
        ignore_eos=True,
    )  # fmt: skip
    model = asyncio.run(preflight(config, transport=transport))
    assert model == "only"
    report = asyncio.run(run_serve_bench(config, model=model, transport=transport))
    assert [(lv.concurrency, lv.completed, lv.output_tokens) for lv in report.levels] == [
        (2, 3, 21),
        (3, 3, 21),
    ]
    assert all(lv.usage_reported and lv.itl_p50_ms is None for lv in report.levels)


def test_percentile_and_summary() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    ok = RequestResult(sent=0.0, ended=1.0, status=200, chunk_times=[0.5, 0.75, 1.0])
    failed = RequestResult(sent=0.0, ended=0.1, status=None, error="ConnectError")
    level = summarize_level(4, 2, [ok, failed], 2.0)
    assert (level.completed, level.errors, level.http_503) == (1, 1, 0)
    assert level.tokens_per_second == pytest.approx(1.5)
    assert level.ttft_p50_ms == pytest.approx(500.0)
    assert level.itl_p50_ms == pytest.approx(250.0)
