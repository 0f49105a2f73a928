"""Observability routes of `mlxcel serve`: /props, /slots, /metrics, /v1/cache/*.

Against real servers on a tiny model: the shared main configuration (`--metrics`, slots
on, props off) and one with every switch the other way (`--no-slots --props
--no-cache-prompt`, no metrics; uvicorn in the test process). Also `mlxcel cache
stats|reset` against the main server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from mlxcel.commands import cache_remote
from prometheus_client.parser import text_string_to_metric_families
from server_harness import InProcessServer, ServeProcess, shared_server
from sse_reader import iter_sse_json
from test_server_openai import API_KEY, AUTH, main_server_args
from typer.testing import CliRunner

UNSET_SEED = 18446744073709551615

SPEC_METRICS = {
    "mlxcel_requests_total": (
        "counter",
        "Total number of completed generation requests; chat completion streams cancelled "
        "by the client are excluded",
    ),
    "mlxcel_prompt_tokens_total": ("counter", "Total prompt tokens processed"),
    "mlxcel_completion_tokens_total": (
        "counter",
        "Total completion tokens of the requests counted in mlxcel_requests_total",
    ),
    "mlxcel_generation_time_seconds_total": ("counter", "Total generation time in seconds"),
    "mlxcel_slots_total": ("gauge", "Total number of parallel slots"),
    "mlxcel_slots_available": ("gauge", "Available parallel slots"),
    "mlxcel_queue_depth": ("gauge", "Current prefill queue depth"),
    "mlxcel_batch_sequences_started": ("counter", "Total sequences that entered prefill"),
    "mlxcel_batch_sequences_completed": ("counter", "Total sequences that completed generation"),
    "mlxcel_batch_prefill_tokens_total": ("counter", "Cumulative prefill tokens processed"),
    "mlxcel_batch_decode_tokens_total": ("counter", "Cumulative decode tokens generated"),
    "mlxcel_batch_current_size": ("gauge", "Current active batch size"),
    "mlxcel_cache_pool_active": ("gauge", "Active cache entries"),
}
LLAMACPP_METRICS = {  # llama-server's families: (type, help), in its order
    "llamacpp:prompt_tokens_total": ("counter", "Number of prompt tokens processed."),
    "llamacpp:prompt_seconds_total": ("counter", "Prompt process time"),
    "llamacpp:tokens_predicted_total": ("counter", "Number of generation tokens processed."),
    "llamacpp:tokens_predicted_seconds_total": ("counter", "Predict process time"),
    "llamacpp:n_decode_total": ("counter", "Total number of llama_decode() calls"),
    "llamacpp:n_tokens_max": ("counter", "Largest observed n_tokens."),
    "llamacpp:spec_decode_num_draft_tokens_total": ("counter", "Total draft tokens generated"),
    "llamacpp:spec_decode_num_accepted_tokens_total": (
        "counter",
        "Total draft tokens accepted by the target model",
    ),
    "llamacpp:spec_decode_num_drafts_total": (
        "counter",
        "Total speculative decoding verification steps",
    ),
    "llamacpp:prompt_tokens_seconds": ("gauge", "Average prompt throughput in tokens/s."),
    "llamacpp:predicted_tokens_seconds": ("gauge", "Average generation throughput in tokens/s."),
    "llamacpp:requests_processing": ("gauge", "Number of requests processing."),
    "llamacpp:requests_deferred": ("gauge", "Number of requests deferred."),
    "llamacpp:n_busy_slots_per_decode": (
        "gauge",
        "Average number of busy slots per llama_decode() call",
    ),
}
LLAMACPP_CACHE_METRICS = {  # the prompt-cache pair of newer llama-servers
    "llamacpp:prompt_tokens_cache_total": "counter",
    "llamacpp:prompt_cache_hit_ratio": "gauge",
}
CACHE_STATS_KEYS = [
    "enabled",
    "apc_enabled",
    "block_size",
    "hash",
    "entries",
    "bytes",
    "capacity_bytes",
    "max_entries",
    "hits",
    "lookups",
    "hit_rate",
    "inserts",
    "evictions_lru",
    "evictions_ttl",
    "rejections_oversized",
    "total_blocks_stored",
    "unique_block_hashes",
    "apc_active_entries",
    "disk",  # the disk tier's (`--prompt-cache-dir`)
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> ServeProcess:
    return shared_server(main_server_args(tiny_llama_dir))


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def off_server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    """Slots off, POST /props on, prompt cache off, no /metrics (uvicorn in this process)."""
    from mlxcel.config import Settings

    settings = Settings(
        model=str(tiny_llama_dir),
        parallel=1,
        ctx_size=512,
        slots=False,
        props=True,
        cache_prompt=False,
        warmup=False,
    )
    with InProcessServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def off(off_server: InProcessServer) -> Iterator[httpx.Client]:
    with off_server.client() as client:
        yield client


def error_of(response: httpx.Response, status: int, type_: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == type_
    return str(error["message"])


def exposition_values(text: str) -> dict[str, float]:
    """`name -> value` of the exposition's sample lines (after checking it parses).

    The values are read from the text itself: `prometheus_client`'s parser renames counter
    samples that lack a `_total` suffix.
    """
    assert list(text_string_to_metric_families(text))
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split(" ")
            values[name] = float(value)
    return values


def metric_values(http: httpx.Client) -> dict[str, float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    return exposition_values(response.text)


def wait_idle(http: httpx.Client, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while any(s["is_processing"] or s["state"] == "queued" for s in http.get("/slots").json()):
        assert time.monotonic() < deadline, "slots did not come back to idle"
        time.sleep(0.05)


# ----------------------------------------------------------------------------------- props


def test_props_shape(http: httpx.Client, tiny_llama_dir: Path) -> None:
    response = http.get("/props")
    assert response.status_code == 200
    props = response.json()
    assert props["total_slots"] == 4
    # the tiny float32 llama: "none", or how the CPU backend runs it ("float32 (...)")
    assert props["model_architecture"] == "llama"
    assert props["model_quantization"].startswith(("none", "float32"))
    defaults = props["default_generation_settings"]
    for key in (
        "n_predict",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repeat_penalty",
        "repeat_last_n",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
    ):
        assert key in defaults, key
    assert defaults["seed"] == UNSET_SEED
    assert defaults["n_predict"] == -1
    assert defaults["temperature"] == pytest.approx(0.8) and defaults["top_k"] == 40
    assert defaults["n_ctx"] == 1024  # -c 4096 over 4 slots
    params = defaults["params"]
    assert params["seed"] == UNSET_SEED and params["top_p"] == pytest.approx(0.95)
    assert isinstance(params["samplers"], list)
    # The model is named, never located.
    assert props["model_path"] == props["model_alias"] == tiny_llama_dir.name
    assert str(tiny_llama_dir) not in response.text
    assert props["endpoint_slots"] is True and props["endpoint_metrics"] is True
    assert props["endpoint_props"] is False
    assert isinstance(props["chat_template"], str)
    assert set(props["modalities"]) == {"vision", "video", "audio"}


def test_get_routes_answer_head(server: ServeProcess, http: httpx.Client) -> None:
    """llama-server answers HEAD on its GET routes (load-balancer probes send HEAD /health);
    they were 405. The GET's status and headers, no body, the key still needed where GET
    needs it, and the connection stays usable."""
    for path in ("/health", "/", "/v1/models", "/props", "/slots", "/metrics"):
        head = http.head(path)
        get = http.get(path)
        assert head.status_code == get.status_code == 200, (path, head.text)
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert httpx.head(f"{server.url}/props").status_code == 401
    assert httpx.head(f"{server.url}/health").status_code == 200
    assert http.head("/v1/chat/completions").status_code == 405  # a POST route: no HEAD


def test_props_post_needs_the_flag(http: httpx.Client, off: httpx.Client) -> None:
    message = error_of(http.post("/props", json={}), 501, "not_supported_error")
    assert "--props" in message
    assert off.post("/props", json={}).json() == {"success": True}
    error_of(
        off.post("/props", content=b"{oops", headers={"Content-Type": "application/json"}),
        400,
        "invalid_request_error",
    )
    assert off.get("/props").json()["endpoint_props"] is True


# ----------------------------------------------------------------------------------- slots


def test_slots_idle(http: httpx.Client) -> None:
    wait_idle(http)
    slots = http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    for slot in slots:
        assert slot["state"] == "idle" and slot["is_processing"] is False
        assert slot["context_size"] == slot["n_ctx"] == 1024
        assert isinstance(slot["model"], str)
        if "params" not in slot:  # never used (llama-server's shape): no task fields at all
            assert "id_task" not in slot and "next_token" not in slot
            continue
        assert slot["params"]["seed"] == UNSET_SEED
        assert slot["next_token"][0]["has_next_token"] is False
    assert http.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 200


def _hold_stream(url: str, stack: ExitStack, keep: list[Any]) -> None:
    """Open a long stream, read its first event and keep the connection open."""
    body = {"prompt": "Once upon a time", "n_predict": 900, "ignore_eos": True, "stream": True}
    response = stack.enter_context(
        httpx.stream("POST", f"{url}/completion", json=body, headers=AUTH, timeout=60)
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    keep.append(lines)
    next(iter_sse_json(lines))


def test_slots_decoding_and_queued(server: ServeProcess, http: httpx.Client) -> None:
    wait_idle(http)
    keep: list[Any] = []
    with ExitStack() as stack:
        for _ in range(4):
            _hold_stream(server.url, stack, keep)
        # A fifth request waits in the queue while the four streams hold every slot.
        queued = stack.enter_context(
            httpx.stream(
                "POST",
                f"{server.url}/completion",
                json={"prompt": "queued", "n_predict": 2, "stream": True},
                headers=AUTH,
                timeout=60,
            )
        )
        deadline = time.monotonic() + 20
        while True:
            slots = http.get("/slots").json()
            if any(s["state"] == "queued" for s in slots):
                break
            assert time.monotonic() < deadline, slots
            time.sleep(0.02)
        assert [s["state"] for s in slots[:4]] == ["decoding"] * 4
        assert all(s["is_processing"] and s["id_task"] >= 0 for s in slots[:4])
        assert all(s["next_token"][0]["n_decoded"] >= 1 for s in slots[:4])
        assert slots[4]["id"] == 4 and slots[4]["is_processing"] is False
        busy = http.get("/slots", params={"fail_on_no_slot": "1"})
        error_of(busy, 503, "server_busy")
        values = metric_values(http)
        assert values["mlxcel_slots_available"] == 0 and values["mlxcel_batch_current_size"] == 4
        assert values["mlxcel_queue_depth"] == 1 and values["llamacpp:requests_deferred"] == 1
        assert values["llamacpp:requests_processing"] == 4
        assert queued.status_code == 200
    wait_idle(http)
    assert metric_values(http)["mlxcel_slots_available"] == 4


def test_slot_actions(http: httpx.Client) -> None:
    first = http.post("/slots/0", params={"action": "erase"}).json()  # what slot 0 held
    assert first["id_slot"] == 0 and first["n_erased"] >= 0
    assert http.post("/slots/0", params={"action": "erase"}).json() == {
        "id_slot": 0,
        "n_erased": 0,
    }
    error_of(http.post("/slots/9", params={"action": "erase"}), 400, "invalid_request_error")
    error_of(http.post("/slots/x", params={"action": "erase"}), 400, "invalid_request_error")
    error_of(http.post("/slots/0", params={"action": "nope"}), 400, "invalid_request_error")
    error_of(http.post("/slots/0", params={"action": "save"}), 501, "not_supported_error")


def test_slots_disabled(off: httpx.Client) -> None:
    message = error_of(off.get("/slots"), 501, "not_supported_error")
    assert "--slots" in message
    error_of(off.post("/slots/0", params={"action": "erase"}), 501, "not_supported_error")


# --------------------------------------------------------------------------------- metrics


def test_metrics_exposition(http: httpx.Client) -> None:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = response.text
    for name, (kind, help_text) in SPEC_METRICS.items():
        assert f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} " in text, name
    llama_blocks = [
        f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} "
        for name, (kind, help_text) in LLAMACPP_METRICS.items()
    ]
    at = [text.index(block) for block in llama_blocks]  # each one, as llama-server writes it
    assert at == sorted(at)  # in llama-server's order: its counters, then its gauges
    for name, kind in LLAMACPP_CACHE_METRICS.items():
        assert f"# TYPE {name} {kind}\n" in text, name
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["mlxcel_slots_total"].type == "gauge"
    assert families["mlxcel_slots_total"].samples[0].value == 4
    assert families["mlxcel_requests"].type == "counter"  # the parser drops `_total`
    values = exposition_values(text)
    assert set(values) == set(SPEC_METRICS) | set(LLAMACPP_METRICS) | set(LLAMACPP_CACHE_METRICS)


def test_metrics_counting(http: httpx.Client) -> None:
    before = metric_values(http)
    body = {"prompt": "Count me", "n_predict": 3, "ignore_eos": True, "temperature": 0}
    result = http.post("/completion", json={**body, "cache_prompt": False}).json()
    after = metric_values(http)
    # Native /completion is counted like every route, from what its answer reports.
    assert after["mlxcel_requests_total"] == before["mlxcel_requests_total"] + 1
    assert after["mlxcel_completion_tokens_total"] == (
        before["mlxcel_completion_tokens_total"] + result["tokens_predicted"]
    )
    assert after["mlxcel_prompt_tokens_total"] == (
        before["mlxcel_prompt_tokens_total"] + result["tokens_evaluated"]
    )
    done = "mlxcel_batch_sequences_completed"
    assert after[done] == before[done] + 1
    assert after["mlxcel_batch_sequences_started"] == before["mlxcel_batch_sequences_started"] + 1
    predicted = "llamacpp:tokens_predicted_total"
    assert result["timings"]["predicted_n"] == 3
    assert after[predicted] == before[predicted] + result["timings"]["predicted_n"]
    processed = "llamacpp:prompt_tokens_total"
    assert after[processed] == before[processed] + result["timings"]["prompt_n"]
    prefill = "mlxcel_batch_prefill_tokens_total"
    assert after[prefill] >= before[prefill] + result["tokens_evaluated"] - 1
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0,
    }
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    counted = metric_values(http)
    assert counted["mlxcel_requests_total"] == after["mlxcel_requests_total"] + 1
    assert counted["mlxcel_completion_tokens_total"] == after["mlxcel_completion_tokens_total"] + 2


def test_metrics_cached_tokens(http: httpx.Client) -> None:
    prompt = "A prompt long enough to fill a couple of cache blocks, again and again. " * 3
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "ignore_eos": True}
    http.post("/completion", json=body)
    before = metric_values(http)
    second = http.post("/completion", json=body).json()
    assert second["timings"]["cache_n"] > 0
    after = metric_values(http)
    cached, processed = "llamacpp:prompt_tokens_cache_total", "llamacpp:prompt_tokens_total"
    assert after[cached] == before[cached] + second["timings"]["cache_n"]
    assert after[processed] == before[processed] + second["timings"]["prompt_n"]
    assert after["llamacpp:prompt_cache_hit_ratio"] == pytest.approx(
        after[cached] / (after[cached] + after[processed])
    )
    assert 0 < after["llamacpp:prompt_cache_hit_ratio"] < 1


def test_metrics_disabled_is_501_as_llama_server(off: httpx.Client) -> None:
    message = error_of(off.get("/metrics"), 501, "not_supported_error")
    assert message == "This server does not support metrics endpoint. Start it with `--metrics`"


# ---------------------------------------------------------------------------- prompt cache


def test_cache_stats_and_reset(http: httpx.Client) -> None:
    prompt = "Cache me if you can, this prompt spans more than one block of tokens. " * 2
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0}
    assert http.post("/completion", json=body).status_code == 200
    stats = http.get("/v1/cache/stats").json()
    assert list(stats) == CACHE_STATS_KEYS
    assert stats["enabled"] is True and stats["apc_enabled"] is False
    assert stats["block_size"] == 16 and stats["hash"] == "sha256"
    assert stats["entries"] >= 1 and stats["bytes"] > 0 and stats["inserts"] >= 1
    assert stats["capacity_bytes"] == 8192 * 1024 * 1024  # --cache-ram default, MiB
    assert stats["hit_rate"] == pytest.approx(stats["hits"] / stats["lookups"])
    assert stats["total_blocks_stored"] >= 1 and stats["unique_block_hashes"] >= 1
    reset = http.post("/v1/cache/reset").json()
    assert reset == {
        "cleared": True,
        "freed_bytes": stats["bytes"],
        "freed_entries": stats["entries"],
    }
    assert http.post("/v1/cache/reset").json() == {
        "cleared": True,
        "freed_bytes": 0,
        "freed_entries": 0,
    }
    cleared = http.get("/v1/cache/stats").json()
    assert cleared["entries"] == 0 and cleared["bytes"] == 0
    assert cleared["lookups"] == stats["lookups"]  # counters survive a reset
    again = http.post("/completion", json=body).json()
    assert again["timings"]["cache_n"] == 0  # nothing left to reuse


def test_cache_disabled_payloads(off: httpx.Client) -> None:
    body = {"prompt": "Disabled cache " * 10, "n_predict": 1, "cache_prompt": True}
    for _ in range(2):  # a request cannot turn the server-wide switch back on
        result = off.post("/completion", json=body).json()
        assert result["timings"]["cache_n"] == 0
    stats = off.get("/v1/cache/stats").json()
    assert list(stats) == CACHE_STATS_KEYS
    assert stats["enabled"] is False
    assert stats["block_size"] == 16 and stats["hash"] == "sha256"
    assert all(stats[k] == 0 for k in ("entries", "bytes", "hits", "lookups", "inserts"))
    expected = {"cleared": True, "freed_bytes": 0, "freed_entries": 0}
    assert off.post("/v1/cache/reset").json() == expected


def test_cache_routes_need_the_key(server: ServeProcess) -> None:
    assert httpx.get(f"{server.url}/v1/cache/stats").status_code == 401
    assert httpx.post(f"{server.url}/v1/cache/reset").status_code == 401
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/props").status_code == 401


# ------------------------------------------------------------------- mlxcel cache stats|reset


def _cli() -> typer.Typer:
    app = typer.Typer()
    app.command("stats")(cache_remote.stats)
    app.command("reset")(cache_remote.reset)
    return app


def test_cache_cli_against_a_server(server: ServeProcess, http: httpx.Client) -> None:
    runner = CliRunner()
    args = ["--url", server.url, "--api-key", API_KEY]
    result = runner.invoke(_cli(), ["stats", *args, "--json"], env={"LLAMA_API_KEY": ""})
    assert result.exit_code == 0, result.output
    payload: dict[str, Any] = json.loads(result.stdout)
    assert list(payload) == CACHE_STATS_KEYS
    table = runner.invoke(_cli(), ["stats", *args], env={"COLUMNS": "120"})
    assert table.exit_code == 0 and "hit_rate" in table.stdout and "sha256" in table.stdout
    reset = runner.invoke(_cli(), ["reset", *args, "--json"])
    assert reset.exit_code == 0 and json.loads(reset.stdout)["cleared"] is True
    plain = runner.invoke(_cli(), ["reset", *args])
    assert plain.exit_code == 0 and "cleared 0 entries" in plain.stdout
    assert http.get("/v1/cache/stats").json()["entries"] == 0


def test_cache_cli_errors(server: ServeProcess) -> None:
    runner = CliRunner()
    denied = runner.invoke(_cli(), ["stats", "--url", server.url], env={"LLAMA_API_KEY": ""})
    assert denied.exit_code == 2
    assert "401" in denied.stderr
    unreachable = runner.invoke(_cli(), ["stats", "--url", "http://127.0.0.1:9"])
    assert unreachable.exit_code == 2 and "cannot reach" in unreachable.stderr
    from_env = runner.invoke(
        _cli(), ["stats", "--url", server.url, "--json"], env={"LLAMA_API_KEY": API_KEY}
    )
    assert from_env.exit_code == 0


# ------------------------------------------------------------- the --metrics-port app alone


def test_metrics_app_before_the_model_loads() -> None:
    from fastapi.testclient import TestClient

    from mlxcel.config import Settings
    from mlxcel.server.ops.routes import metrics_app
    from mlxcel.server.state import ServerState

    state = ServerState(settings=Settings(api_key=["k"], metrics_port=9999))
    with TestClient(metrics_app(state)) as client:
        assert client.get("/metrics").status_code == 401
        response = client.get("/metrics", headers={"Authorization": "Bearer k"})
        assert response.status_code == 200
        values = exposition_values(response.text)
        assert values["mlxcel_slots_total"] == 0 and values["mlxcel_requests_total"] == 0
        assert set(SPEC_METRICS) <= set(values)
        assert client.get("/props", headers={"Authorization": "Bearer k"}).status_code == 404
