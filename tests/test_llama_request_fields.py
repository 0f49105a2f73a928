"""llama-server/OpenAI fields of issue 16 through a real `mlxcel serve`: `n` > 1 choices,
`usage.prompt_tokens_details.cached_tokens`, the context-overflow 400's `n_prompt_tokens`
and `n_ctx`, `--reasoning auto`, embeddings inputs, `timings_per_token` and
`return_progress` on native /completion streams.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.tiny_encoders import build_tiny_bert
from server_harness import API_KEY, AUTH, ServeProcess
from sse_reader import DONE, sse_json, sse_payloads
from test_server_tools import QWEN_STYLE_TEMPLATE, make_app

HI = [{"role": "user", "content": "Hi"}]
CTX_PER_SLOT = 512  # -c 1024 over 2 slots


BERT_LIMIT = 24  # the tiny BERT's positions


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny llama (prefill in chunks of 16 tokens) with a tiny BERT for embeddings."""
    bert = build_tiny_bert(tmp_path_factory.mktemp("bert") / "bert", positions=BERT_LIMIT)
    args = [
        "-m", str(tiny_llama_dir), "-c", "1024", "-np", "2", "-b", "16",
        "--api-key", API_KEY, "--embedding-model", str(bert),
    ]  # fmt: skip
    with ServeProcess(args).start() as proc:
        yield proc.url


@pytest.fixture(scope="module")
def thinking_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A template with an `enable_thinking` switch, under the default `--reasoning auto`."""
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = ["-m", str(tiny_llama_dir), "-c", "1024", "-np", "1", "--api-key", API_KEY]
    with ServeProcess([*args, "--chat-template-file", str(template)]).start() as proc:
        yield proc.url


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)


def _stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The JSON of every `data:` line of a streamed answer (`[DONE]` as the string)."""
    with httpx.stream(
        "POST", f"{url}{path}", json={**body, "stream": True}, headers=AUTH, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        payloads = sse_payloads(response.iter_lines())
    return [data if data == DONE else json.loads(data) for data in payloads]


# ------------------------------------------------------------------------------ n > 1


def test_chat_n_choices_count_the_prompt_once(server: str) -> None:
    # No prompt cache: the answers compared below then run the very same computation.
    body = {
        "messages": HI, "max_tokens": 4, "n": 3, "seed": 7, "ignore_eos": True,
        "cache_prompt": False,
    }  # fmt: skip
    answer = _post(server, "/v1/chat/completions", body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "length"
        assert isinstance(choice["message"]["content"], str)
    single = _post(server, "/v1/chat/completions", {**body, "n": 1}).json()
    usage = answer["usage"]
    assert usage["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == 3 * 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    # Choice 0 samples with the request's seed: the same text as the n=1 answer.
    assert answer["choices"][0]["message"] == single["choices"][0]["message"]
    texts = {c["message"]["content"] for c in answer["choices"]}
    assert len(texts) > 1  # seeds seed, seed+1, seed+2 at temperature 0.8 differ
    with_logprobs = _post(
        server, "/v1/chat/completions", {**body, "n": 2, "logprobs": True, "top_logprobs": 2}
    ).json()
    for choice in with_logprobs["choices"]:  # each choice reports its own tokens
        content = choice["logprobs"]["content"]
        assert len(content) == 4 and all(len(e["top_logprobs"]) == 2 for e in content)


def test_chat_n_choices_stream_with_their_index(server: str) -> None:
    body = {
        "messages": HI,
        "max_tokens": 3,
        "n": 2,
        "seed": 3,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,
    }
    chunks = _stream(server, "/v1/chat/completions", body)
    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    usage_chunks = [c for c in data if c.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is data[-1]
    assert usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"]["completion_tokens"] == 6
    finishes: dict[int, str] = {}
    text: dict[int, str] = {0: "", 1: ""}
    for chunk in data[:-1]:
        (choice,) = chunk["choices"]
        text[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    collected = _post(server, "/v1/chat/completions", {**body, "stream": False}).json()
    assert [c["message"]["content"] for c in collected["choices"]] == [text[0], text[1]]


def test_completions_n_choices(server: str) -> None:
    body = {
        "prompt": "Once upon", "max_tokens": 3, "n": 2, "seed": 11, "ignore_eos": True,
        "cache_prompt": False,
    }  # fmt: skip
    answer = _post(server, "/v1/completions", body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["usage"]["completion_tokens"] == 6
    chunks = _stream(server, "/v1/completions", body)
    streamed = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert [streamed[0], streamed[1]] == [c["text"] for c in answer["choices"]]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"n_predict": 2, "max_tokens": 5}, 2),
        ({"n_predict": 2, "max_completion_tokens": 5}, 2),
        ({"n_predict": 3}, 3),
    ],
)
def test_openai_routes_read_n_predict_first(
    server: str, limits: dict[str, int], expected: int
) -> None:
    """llama-server reads `n_predict` before `max_tokens` on every route; the OpenAI routes
    ignored it and generated up to the context."""
    common = {"ignore_eos": True, "cache_prompt": False, "temperature": 0, **limits}
    for path, body in (
        ("/v1/chat/completions", {"messages": HI, **common}),
        ("/v1/completions", {"prompt": "Once upon", **common}),
    ):
        answer = _post(server, path, body).json()
        assert answer["usage"]["completion_tokens"] == expected, (path, answer)


def test_loop_detection_size_is_bounded(server: str) -> None:
    """`max_pattern_size` sizes the loop detector's lists: 2**64 made the server grow one
    until the kernel killed it. Over 4096 is a 400 naming the field; the server stays up."""
    body = {"prompt": "Once upon", "max_tokens": 2, "min_count": 4}
    for path in ("/v1/completions", "/completion"):
        ok = _post(server, path, {**body, "max_pattern_size": 4096})
        assert ok.status_code == 200, ok.text
        refused = _post(server, path, {**body, "max_pattern_size": 4097})
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "max_pattern_size must be at most 4096" in message
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_400(server: str, n: int) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": HI, "n": n}),
        ("/v1/completions", {"prompt": "a", "n": n}),
    ):
        response = _post(server, path, {**body, "max_tokens": 1})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "n:" in error["message"]


# --------------------------------------------------------------------- cached tokens


def test_usage_reports_cached_prompt_tokens(server: str) -> None:
    messages = [{"role": "user", "content": "Tell me a long story about a cat " * 4}]
    body = {"messages": messages, "max_tokens": 2}
    first = _post(server, "/v1/chat/completions", body).json()["usage"]
    second = _post(server, "/v1/chat/completions", body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= second["prompt_tokens"]
    streamed = _stream(
        server,
        "/v1/chat/completions",
        {**body, "stream_options": {"include_usage": True}},
    )
    usage = streamed[-2]["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]
    prompt = "A cached completion prompt, long enough to reuse " * 3
    _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    again = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


# ------------------------------------------------------------------ context overflow


def test_context_overflow_names_the_prompt_and_context_sizes(server: str) -> None:
    long = " ".join(["word"] * 800)
    for path, body in (
        ("/v1/completions", {"prompt": long}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
        ("/completion", {"prompt": long}),
    ):
        response = _post(server, path, {**body, "max_tokens": 1})
        assert response.status_code == 400, path
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "context_length_exceeded"
        assert error["n_ctx"] == CTX_PER_SLOT
        assert error["n_prompt_tokens"] > CTX_PER_SLOT


# -------------------------------------------------------------------- --reasoning auto


def test_reasoning_auto_turns_a_templates_thinking_switch_on(thinking_server: str) -> None:
    prompt = _post(thinking_server, "/apply-template", {"messages": HI}).json()["prompt"]
    assert prompt.endswith("<think>\n")  # rendered with enable_thinking: true
    off = _post(
        thinking_server,
        "/apply-template",
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["prompt"]
    assert "<think>" not in off  # the request's value wins
    body = {"messages": HI, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    message = _post(thinking_server, "/v1/chat/completions", body).json()["choices"][0]
    # The prompt opened the block: what the model writes is split out as reasoning.
    assert message["message"]["reasoning_content"]
    budget = _post(thinking_server, "/apply-template", {"messages": HI, "thinking_budget": 0})
    assert "<think>" not in budget.json()["prompt"]  # a zero budget still means off


def test_reasoning_auto_leaves_a_template_without_the_switch(server: str) -> None:
    plain = _post(server, "/apply-template", {"messages": HI}).json()["prompt"]
    forced = _post(
        server,
        "/apply-template",
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}},
    ).json()["prompt"]
    assert plain == forced and "<think>" not in plain


# -------------------------------------------------------------------------- embeddings


def test_embeddings_accept_empty_and_mixed_inputs(server: str) -> None:
    empty = _post(server, "/v1/embeddings", {"input": ""})
    assert empty.status_code == 200, empty.text
    (item,) = empty.json()["data"]
    assert len(item["embedding"]) == 16 and any(x != 0 for x in item["embedding"])
    text = _post(server, "/v1/embeddings", {"input": "a cat"}).json()["data"][0]["embedding"]
    cls_id, sep_id = 2, 3  # the tiny BERT vocabulary's [CLS] and [SEP]
    mixed = _post(server, "/v1/embeddings", {"input": [[cls_id, 9, sep_id], "a cat", ""]})
    assert mixed.status_code == 200, mixed.text
    data = mixed.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert data[1]["embedding"] == pytest.approx(text, abs=1e-5)
    native = _post(server, "/embedding", {"content": ["", [cls_id, 9, sep_id]]})
    assert native.status_code == 200 and len(native.json()) == 2


@pytest.mark.parametrize("path", ["/v1/embeddings", "/embedding", "/embeddings"])
def test_embedding_input_over_the_limit_is_too_large(server: str, path: str) -> None:
    body = {"input": "cat " * 40} if path == "/v1/embeddings" else {"content": "cat " * 40}
    response = _post(server, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    assert "too large" in error["message"]
    assert error["n_ctx"] == BERT_LIMIT and error["n_prompt_tokens"] > BERT_LIMIT


# ------------------------------------------------- timings_per_token, return_progress

TIMING_FIELDS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}  # fmt: skip


def test_native_stream_timings_per_token(server: str) -> None:
    body = {"prompt": "Once upon a time", "n_predict": 4, "ignore_eos": True}
    chunks = _stream(server, "/completion", {**body, "timings_per_token": True})
    partial = [c for c in chunks if c["tokens"]]  # a token's chunk each (not a text tail)
    assert len(partial) == 4
    for n, chunk in enumerate(partial, 1):
        assert set(chunk["timings"]) >= TIMING_FIELDS
        assert chunk["timings"]["predicted_n"] == n
        assert chunk["timings"]["prompt_n"] + chunk["timings"]["cache_n"] > 0
    assert chunks[-1]["stop"] is True and set(chunks[-1]["timings"]) >= TIMING_FIELDS
    plain = _stream(server, "/completion", body)
    assert all("timings" not in c for c in plain if not c["stop"])


def test_native_stream_return_progress(server: str) -> None:
    prompt = "This is a test of prompt progress " * 6  # several 16-token prefill chunks
    body = {"prompt": prompt, "n_predict": 2, "ignore_eos": True, "return_progress": True}
    chunks = _stream(server, "/completion", body)
    first_token = next(i for i, c in enumerate(chunks) if c.get("tokens"))
    reports = [c["prompt_progress"] for c in chunks[:first_token] if "prompt_progress" in c]
    assert all("prompt_progress" not in c for c in chunks[first_token:])
    assert len(reports) >= 3
    total = reports[0]["total"]
    assert total == chunks[-1]["tokens_evaluated"]
    assert reports[0]["processed"] == reports[0]["cache"]
    processed = [r["processed"] for r in reports]
    assert processed == sorted(set(processed)) and processed[-1] == total
    assert all(r["total"] == total and r["time_ms"] >= 0 for r in reports)
    # One report at admission, then one per prefill chunk of 16 (-b), as llama-server.
    assert len(reports) == 1 + math.ceil((total - reports[0]["cache"]) / 16)
    again = _stream(server, "/completion", body)  # the prompt cache now serves most of it
    cached = [c["prompt_progress"] for c in again if "prompt_progress" in c]
    assert cached[0]["cache"] > 0 and cached[0]["processed"] == cached[0]["cache"]
    assert cached[-1]["processed"] == total
    assert len(cached) == 1 + math.ceil((total - cached[0]["cache"]) / 16)


def test_chat_stream_timings_and_progress(server: str) -> None:
    messages = [{"role": "user", "content": "This is a test " * 12}]
    body = {
        "messages": messages,
        "max_tokens": 3,
        "ignore_eos": True,
        "timings_per_token": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,  # a chunk for every token, even one whose text is held back
    }
    chunks = _stream(server, "/v1/chat/completions", body)[:-1]
    reports = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(reports) >= 2 and reports[-1]["processed"] == reports[-1]["total"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    for chunk in chunks[1 : 1 + len(reports)]:  # then the reports, as llama-server's role deltas
        assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": None}
    timed = [c for c in chunks[:-1] if "timings" in c and c["choices"][0]["finish_reason"] is None]
    assert timed and all(set(c["timings"]) >= TIMING_FIELDS for c in timed)
    assert [c["timings"]["predicted_n"] for c in timed] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and set(chunks[-1]["timings"]) >= TIMING_FIELDS


def test_completions_stream_timings_and_progress(server: str) -> None:
    body = {
        "prompt": "A completion prompt for timings and progress " * 4,
        "max_tokens": 3,
        "ignore_eos": True,
        "logprobs": 0,  # a chunk for every token, even one whose text is held back
        "timings_per_token": True,
        "return_progress": True,
    }
    chunks = _stream(server, "/v1/completions", body)[:-1]
    reports = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert len(reports) >= 2 and reports[-1]["processed"] == reports[-1]["total"]
    assert all(c["choices"][0]["text"] == "" for c in chunks[: len(reports)])
    timed = [c for c in chunks if "timings" in c and c["choices"][0]["finish_reason"] is None]
    assert [c["timings"]["predicted_n"] for c in timed] == [1, 2, 3]
    plain = _stream(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})[:-1]
    assert all("timings" not in c and "prompt_progress" not in c for c in plain)


def test_responses_stream_timings_and_progress(server: str) -> None:
    body = {
        "input": "This is a test of the responses route " * 4,
        "max_output_tokens": 8,
        "timings_per_token": True,
        "return_progress": True,
        "ignore_eos": True,
    }
    events = _stream(server, "/v1/responses", body)
    progress = [e for e in events if "prompt_progress" in e]
    assert len(progress) >= 2 and all(e["type"] == "response.in_progress" for e in progress)
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    timed = [e for e in events if e["type"].endswith(".delta") and "timings" in e]
    assert timed and all(set(e["timings"]) >= TIMING_FIELDS for e in timed)
    (completed,) = [e for e in events if e["type"] in ("response.completed", "response.incomplete")]
    assert set(completed["timings"]) >= TIMING_FIELDS
    plain = _stream(server, "/v1/responses", {**body, "timings_per_token": False})
    assert all("timings" not in e for e in plain)


def test_native_progress_from_an_engine_without_prefill_reports(hf_tokenizer: Any) -> None:
    """An engine that sends no progress events (the vision engine): /completion still sends
    one report, the prompt processed, before the first token."""
    app, _ = make_app(hf_tokenizer, ["a", "b"])
    body = {"prompt": "Hello there", "stream": True, "return_progress": True}

    async def go() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.post("/completion", json=body)).text

    chunks = sse_json(asyncio.run(go()))
    assert "prompt_progress" in chunks[0] and "prompt_progress" not in chunks[1]
    progress = chunks[0]["prompt_progress"]
    assert progress["processed"] == progress["total"] == chunks[1]["tokens_evaluated"] > 0
    assert [c["content"] for c in chunks[1:3]] == ["a", "b"]
