"""The OpenAI routes of `mlxcel serve`, against a real server process on a tiny model.

Clients are the official `openai` SDK and httpx. Generation is greedy (`temperature: 0`)
with `ignore_eos` where a test needs an exact token count, so results are deterministic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import API_KEY, AUTH, MESSAGES, ServeProcess, main_server_args, shared_server
from sse_reader import sse_json, sse_payloads, sse_stream_json


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> ServeProcess:
    return shared_server(main_server_args(tiny_llama_dir))


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def metric(http: httpx.Client, name: str) -> float:
    response = http.get("/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} missing from /metrics")


def greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0, **extra}


# ------------------------------------------------------------------------ chat completions


def test_chat_completion_with_sdk(sdk: openai.OpenAI, server: ServeProcess) -> None:
    result = sdk.chat.completions.create(
        model="any-name-at-all",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    assert result.model == "any-name-at-all"  # echoed; it never selects anything
    choice = result.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_chat_stream_with_sdk_include_usage(sdk: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = sdk.chat.completions.create(**kwargs)
    chunks = list(
        sdk.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # type: ignore[union-attr]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_wire_format(http: httpx.Client) -> None:
    body = {"model": "wire", "messages": MESSAGES, "max_tokens": 3, "stream": True, **greedy()}
    response = http.post("/v1/chat/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200
    chunks = sse_stream_json(response, done=True)
    keys = ["id", "object", "created", "model", "system_fingerprint", "choices"]
    for chunk in chunks:
        assert list(chunk)[:6] == keys
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "wire"
        assert chunk["system_fingerprint"] is None
    first, *middle, last = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None, "logprobs": None}
    ]
    assert last["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    ]
    assert middle and all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert "usage" not in last  # include_usage was not asked for


def test_chat_alias_route_and_stop_reason(http: httpx.Client) -> None:
    base = {"messages": MESSAGES, "max_tokens": 8, "ignore_eos": True, **greedy()}
    first = http.post("/chat/completions", json=base)
    assert first.status_code == 200
    text = first.json()["choices"][0]["message"]["content"]
    assert first.json()["choices"][0]["finish_reason"] == "length"
    stop = text[len(text) // 2 :][:2]
    assert stop
    cut = http.post("/v1/chat/completions", json={**base, "stop": [stop, "never-there"]}).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    single = http.post("/v1/chat/completions", json={**base, "stop": stop}).json()
    assert single["choices"][0]["message"]["content"] == text[: text.index(stop)]


def test_chat_logprobs(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    response = http.post("/v1/chat/completions", json={**body, "ignore_eos": True, **greedy()})
    assert response.status_code == 200
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        # greedy: the sampled token is the most likely one
        assert entry["id"] == entry["top_logprobs"][0]["id"]
        assert bytes(entry["bytes"]).decode("utf-8", "replace") is not None


# ----------------------------------------------------------------------------- completions


def test_completions_with_sdk(sdk: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "c", "max_tokens": 4, "temperature": 0}
    args["extra_body"] = {"ignore_eos": True}
    result = sdk.completions.create(prompt="Hello world", **args)
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert result.model == "c"
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 4
    text = result.choices[0].text
    listed = sdk.completions.create(prompt=["Hello world"], **args)
    assert listed.choices[0].text == text
    echoed = sdk.completions.create(prompt="Hello world", echo=True, **args)
    assert echoed.choices[0].text == "Hello world" + text


def test_completions_token_ids_prompt(http: httpx.Client) -> None:
    body = {"max_tokens": 3, "ignore_eos": True, **greedy()}
    text = http.post("/v1/completions", json={**body, "prompt": "Hello world"}).json()
    ids = http.post("/tokenize", json={"content": "Hello world", "add_special": True}).json()
    tokens = [t if isinstance(t, int) else t["id"] for t in ids["tokens"]]
    by_ids = http.post("/v1/completions", json={**body, "prompt": tokens}).json()
    assert by_ids["usage"]["prompt_tokens"] == len(tokens) == text["usage"]["prompt_tokens"]
    assert by_ids["choices"][0]["text"] == text["choices"][0]["text"]
    nested = http.post("/v1/completions", json={**body, "prompt": [tokens]}).json()
    assert nested["choices"][0]["text"] == text["choices"][0]["text"]


def test_completions_stream_with_sdk(sdk: openai.OpenAI) -> None:
    args: dict[str, Any] = {"model": "c", "prompt": "The quick", "max_tokens": 5, "temperature": 0}
    args["extra_body"] = {"ignore_eos": True}
    whole = sdk.completions.create(**args)
    chunks = list(
        sdk.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-2].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_completions_logprobs(http: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 3, "logprobs": 2, "ignore_eos": True, **greedy()}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][0] == 0
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])


# ----------------------------------------------------------------------- models and health


def test_models_lists_one_model(http: httpx.Client, tiny_llama_dir: Path) -> None:
    for path in ("/v1/models", "/models"):
        body = http.get(path).json()
        assert body["object"] == "list"
        assert len(body["data"]) == 1
        entry = body["data"][0]
        assert entry["id"] == tiny_llama_dir.name
        assert entry["object"] == "model" and entry["owned_by"] == "user"
        assert isinstance(entry["created"], int)


def test_health_shape(server: ServeProcess) -> None:
    for path in ("/health", "/"):
        response = httpx.get(server.url + path)  # public: no key needed
        assert response.status_code == 200
        body = response.json()
        assert body["status"] == "ok"
        assert body["batch"]["max_batch_size"] == 4
        assert body["context_size"] == 1024  # -c 4096 split across 4 slots
        assert set(body["observability"]) >= {
            "sequences_started",
            "sequences_completed",
            "total_prefill_tokens",
            "total_decode_tokens",
            "current_batch_size",
            "cache_pool_active",
        }
        assert "tool_call_parser" in body


# ----------------------------------------------------------------- concurrency and cancel


def _stream_ids(url: str, prompt: str, n: int) -> list[int]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "stream": True,
        "logprobs": True,
        "ignore_eos": True,
        "cache_prompt": False,
        **greedy(),
    }
    ids: list[int] = []
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200
        for chunk in sse_json(r.iter_lines()):
            for choice in chunk["choices"]:
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    ids.append(entry["id"])
    return ids


def test_eight_concurrent_streams_match_solo_runs(server: ServeProcess, http: httpx.Client) -> None:
    prompts = [f"Request number {i}: tell me about {word}" for i, word in enumerate("abcdefgh")]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _stream_ids(server.url, prompts[i], 12)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    for i, prompt in enumerate(prompts):
        solo = _stream_ids(server.url, prompt, 12)
        assert len(results[i]) == 12
        assert results[i] == solo, f"prompt {i}: batched {results[i]} != solo {solo}"


def _active(server: ServeProcess) -> int:
    return int(httpx.get(f"{server.url}/health").json()["batch"]["active_sequences"])


def test_client_disconnect_frees_slot_and_is_not_counted(
    server: ServeProcess, http: httpx.Client
) -> None:
    before = metric(http, "mlxcel_requests_total")
    completed = httpx.get(f"{server.url}/health").json()["observability"]["sequences_completed"]
    body = {"messages": MESSAGES, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as response:
        lines = response.iter_lines()  # kept alive: leaving the loop would close the socket
        data = sse_payloads(next(lines) for _ in range(6))
        assert len(data) == 3
        assert _active(server) == 1  # still generating while we hold the connection
    # the connection is closed here, with hundreds of tokens still to go
    deadline = time.monotonic() + 15
    while _active(server) != 0:
        assert time.monotonic() < deadline, "the slot was not freed after the disconnect"
        time.sleep(0.05)
    health = httpx.get(f"{server.url}/health").json()
    assert health["observability"]["sequences_completed"] == completed  # cancelled, not done
    slots = http.get("/slots").json()
    assert all(not slot.get("is_processing") for slot in slots)
    assert metric(http, "mlxcel_requests_total") == before  # cancelled streams are not counted


def test_request_counting(http: httpx.Client) -> None:
    before = metric(http, "mlxcel_requests_total")
    tokens_before = metric(http, "mlxcel_completion_tokens_total")
    chat = {"messages": MESSAGES, "max_tokens": 2, "ignore_eos": True, **greedy()}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
    completion = {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True, **greedy()}
    assert http.post("/v1/completions", json=completion).status_code == 200
    # every route counts, streamed or not
    assert http.post("/v1/completions", json={**completion, "stream": True}).status_code == 200
    assert metric(http, "mlxcel_requests_total") == before + 4
    assert metric(http, "mlxcel_completion_tokens_total") == tokens_before + 8


def test_priority_header(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, **greedy()}
    for value in ("high", "normal", "LOW"):
        response = http.post("/v1/chat/completions", json=body, headers={"X-Priority": value})
        assert response.status_code == 200
    bad = http.post("/v1/chat/completions", json=body, headers={"X-Priority": "urgent"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
