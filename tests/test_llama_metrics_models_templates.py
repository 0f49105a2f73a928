"""llama-server fidelity of issue 34 (items 6 and 7), through real `mlxcel serve` processes.

`/metrics` counters against what the answers report (predicted tokens and times, embedding
prompts); `/models` and `/v1/models` without an API key, as llama-server's public
endpoints; a streamed chat whose prompt overflows the context refused before the stream
starts; today's `date_string` in chat templates (llama.cpp's extra template context).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import AUTH, main_server_args, serve, shared_server
from sse_reader import sse_json
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_server_ops import metric_values

from mlxcel.engine.chat.template import ChatTemplate, TemplateError
from mlxcel.server.middleware import ApiKeys, RequestGuard

PREDICTED = "llamacpp:tokens_predicted_total"
PREDICTED_SECONDS = "llamacpp:tokens_predicted_seconds_total"
PROMPT = "llamacpp:prompt_tokens_total"
PROMPT_SECONDS = "llamacpp:prompt_seconds_total"


@pytest.fixture
def http(tiny_llama_dir: Path) -> Iterator[httpx.Client]:
    """The shared main server (`--api-key`, `--metrics`, 4 slots of 1024 tokens), keyed."""
    with shared_server(main_server_args(tiny_llama_dir)).client(headers=AUTH) as client:
        yield client


# ----------------------------------------------------------------------------- /metrics


def test_predicted_totals_are_the_sum_of_the_answers(http: httpx.Client) -> None:
    """`tokens_predicted_total` grows by the completion tokens the answers report, and the
    time counters by their `timings` (generation time starts at the first token, so the
    rate leaves the first token's wait out, as llama-server's `t_token_generation`)."""
    before = metric_values(http)
    native = {"prompt": "Count the tokens", "n_predict": 3, "ignore_eos": True}
    answers = [http.post("/completion", json={**native, "n_predict": n}).json() for n in (1, 3)]
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "n": 2,
        "ignore_eos": True,
    }
    many = http.post("/v1/chat/completions", json=chat).json()
    streamed = http.post(
        "/v1/chat/completions",
        json={
            **chat,
            "n": 1,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    (usage,) = [c["usage"] for c in sse_json(streamed.text) if c.get("usage")]
    after = metric_values(http)
    completion = sum(a["tokens_predicted"] for a in answers)
    completion += many["usage"]["completion_tokens"] + usage["completion_tokens"]
    assert completion == 1 + 3 + 2 * 2 + 4
    assert after[PREDICTED] - before[PREDICTED] == completion
    # The native answers' own generation and prompt times are summed in seconds.
    native_predicted = sum(a["timings"]["predicted_ms"] for a in answers) / 1000
    native_prompt = sum(a["timings"]["prompt_ms"] for a in answers) / 1000
    moved_predicted = after[PREDICTED_SECONDS] - before[PREDICTED_SECONDS]
    moved_prompt = after[PROMPT_SECONDS] - before[PROMPT_SECONDS]
    assert moved_predicted >= native_predicted - 1e-9
    assert moved_prompt >= native_prompt - 1e-9
    # The rate gauges are the totals' quotients, as llama-server computes them.
    assert after["llamacpp:predicted_tokens_seconds"] == pytest.approx(
        after[PREDICTED] / after[PREDICTED_SECONDS]
    )
    assert after["llamacpp:prompt_tokens_seconds"] == pytest.approx(
        after[PROMPT] / after[PROMPT_SECONDS]
    )


def test_embedding_prompts_count_as_processed_prompt_tokens() -> None:
    """Embedding inputs are prompts the model evaluates: counted in `prompt_tokens_total`
    (OpenAI and native routes alike), with their time in `prompt_seconds_total`."""
    text = "A man is eating food."
    with serve(["--embedding", "--metrics"]) as server, server.client() as http:
        before = metric_values(http)
        one = http.post("/v1/embeddings", json={"input": text})
        two = http.post("/v1/embeddings", json={"input": [text, "A cat."]})
        native = http.post("/embedding", json={"content": text})
        assert native.status_code == 200, native.text
        after = metric_values(http)
    evaluated = one.json()["usage"]["prompt_tokens"]  # the native input's count too
    assert evaluated > 0
    expected = evaluated + two.json()["usage"]["prompt_tokens"] + evaluated
    assert after[PROMPT] - before[PROMPT] == expected
    assert after[PROMPT_SECONDS] > before[PROMPT_SECONDS]


# ----------------------------------------------------------------------- public routes


def test_models_are_public_as_in_llama_server(http: httpx.Client) -> None:
    """llama-server's public endpoints: `/health`, `/models`, `/v1/models` need no key;
    every other route still does."""
    with httpx.Client(base_url=http.base_url, timeout=60) as anon:
        for path in ("/models", "/v1/models"):
            listed = anon.get(path)
            assert listed.status_code == 200, listed.text
            assert listed.json()["data"][0]["object"] == "model"
        assert anon.get("/health").status_code == 200
        for method, path in (("GET", "/props"), ("POST", "/v1/chat/completions")):
            refused = anon.request(method, path, json={"messages": []})
            assert refused.status_code == 401, path
            assert refused.json()["error"]["type"] == "missing_api_key"


def test_keyless_paths_still_wait_for_the_model() -> None:
    """A keyless path needs no key but answers 503 while the model loads (llama-server
    lets only its web UI through then); the public ones answer at once."""

    async def ok(_: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/v1/models", ok), Route("/health", ok)])
    guarded = RequestGuard(
        inner,
        api_keys=ApiKeys(["secret"]),
        public_paths={"/health"},
        keyless_paths={"/v1/models"},
        max_body_size=1024,
        is_loading=lambda: True,
    )
    with TestClient(guarded) as client:
        assert client.get("/health").status_code == 200
        loading = client.get("/v1/models")
        assert loading.status_code == 503 and loading.json()["error"]["type"] == "server_busy"


# -------------------------------------------------------------------- context overflow


def test_streamed_chat_over_the_context_is_a_400_before_the_stream(http: httpx.Client) -> None:
    """As llama-server: the overflow is a plain JSON 400 (with `n_prompt_tokens` and
    `n_ctx`), not an SSE stream that fails later."""
    messages = [
        {"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"},
    ] * 200
    with http.stream(
        "POST", "/v1/chat/completions", json={"messages": messages, "stream": True}
    ) as response:
        body = json.loads(response.read())
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    error = body["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["n_prompt_tokens"] > error["n_ctx"] > 0


# ------------------------------------------------------------------ date in templates

LLAMA3_DATE = (
    '{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}'
    "Today Date: {{ date_string }}|{{ datetime }}"
)


def test_templates_see_today_as_llama_cpp_passes_it() -> None:
    """llama.cpp gives every Jinja template `date_string` ("%d %b %Y", which Llama 3.x
    templates print instead of their "26 Jul 2024" default) and `datetime` ("%b %d %Y")
    from the server's clock; a chat_template_kwargs value wins."""
    template = ChatTemplate(LLAMA3_DATE, bos_token="", eos_token="")
    days = {datetime.now()}
    text = template.render([{"role": "user", "content": "What is today?"}])
    days.add(datetime.now())  # the render may straddle midnight
    expected = {f"Today Date: {d:%d %b %Y}|{d:%b %d %Y}" for d in days}
    assert text in expected
    given = template.render([], template_kwargs={"date_string": "1 Jan 2025"})
    assert given.startswith("Today Date: 1 Jan 2025|")


# ----------------------------------------------------------------- Anthropic Messages


def test_anthropic_empty_messages_are_accepted_as_llama_server(http: httpx.Client) -> None:
    """llama-server generates from an empty conversation (the template rendered without
    turns) instead of refusing it as Anthropic's API does."""
    body = {"model": "test", "max_tokens": 4, "messages": []}
    answer = http.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    message = answer.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] > 0
    with_system = http.post("/v1/messages", json={**body, "system": "Be brief."})
    assert with_system.status_code == 200, with_system.text
    streamed = http.post("/v1/messages", json={**body, "stream": True})
    assert streamed.status_code == 200
    assert "event: message_stop" in streamed.text
    counted = http.post("/v1/messages/count_tokens", json={"model": "test", "messages": []})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    # what is not a list of turns stays a 400
    refused = http.post("/v1/messages", json={**body, "messages": "Hi"})
    assert refused.status_code == 400 and refused.json()["type"] == "error"


def test_a_string_plus_undefined_or_none_is_the_string_as_in_llama_cpp() -> None:
    """llama.cpp's Jinja runtime adds a string and an undefined value (or None) as if the
    latter were "" (the Firefunction v2 template adds its never-defined `functions`);
    any other arithmetic on an undefined value is still an error."""
    source = '{%- set x = "Functions:" + functions -%}{{ x }}|{{ none + "b" }}|{{ "c" + none }}'
    assert ChatTemplate(source, bos_token="", eos_token="").render([]) == "Functions:|b|c"
    with pytest.raises(TemplateError):
        ChatTemplate("{{ 1 + functions }}", bos_token="", eos_token="").render([])


# ----------------------------------------------------------------------------- __verbose


def test_verbose_field_adds_the_native_result(http: httpx.Client) -> None:
    """llama-server's `verbose: true` puts its native result object under `__verbose` on
    chat and completions answers, collected and streamed (its `prompt` is the prompt the
    model read, its `content` the answer); without it there is none."""
    tokens = http.post("/tokenize", json={"content": "Say hi", "add_special": True}).json()[
        "tokens"
    ]
    prompt_text = http.post("/detokenize", json={"tokens": tokens}).json()["content"]
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}
    body = http.post("/v1/chat/completions", json={**chat, "verbose": True}).json()
    report = body["__verbose"]
    assert "Say hi" in report["prompt"] and report["stop"] is True
    assert report["content"] == body["choices"][0]["message"]["content"]
    assert report["tokens_predicted"] == body["usage"]["completion_tokens"]
    assert report["generation_settings"]["n_predict"] == 3
    assert "__verbose" not in http.post("/v1/chat/completions", json=chat).json()
    assert (
        "__verbose" not in http.post("/v1/chat/completions", json={**chat, "verbose": False}).json()
    )

    streamed = http.post("/v1/chat/completions", json={**chat, "verbose": True, "stream": True})
    chunks = sse_json(streamed.text)
    (last,) = [c for c in chunks if c.get("__verbose")]
    assert last["choices"][0]["finish_reason"] is not None
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert last["__verbose"]["content"] == text

    legacy = {"prompt": "Say hi", "max_tokens": 3, "verbose": True}
    completion = http.post("/v1/completions", json=legacy).json()
    assert completion["__verbose"]["prompt"] == prompt_text
    assert completion["__verbose"]["content"] == completion["choices"][0]["text"]
    bad = http.post("/v1/chat/completions", json={**chat, "verbose": "yes"})
    assert bad.status_code == 400 and "verbose" in bad.json()["error"]["message"]


def test_a_prefill_of_text_parts_joins_them_with_a_blank_line(http: httpx.Client) -> None:
    """The assistant message the model continues, given as text parts, is their text joined
    by a blank line, as llama.cpp renders a continued message (`render_content`)."""
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": parts}]
    prompt = http.post("/apply-template", json={"messages": messages}).json()["prompt"]
    assert prompt.endswith("assistant\nWh\n\nill")
    plain = [*messages[:1], {"role": "assistant", "content": "Whill"}]
    assert http.post("/apply-template", json={"messages": plain}).json()["prompt"].endswith("Whill")
