"""The family-neutral chat core (`mlxcel.server.chat`): what each family's request
becomes, once per request.

Through the HTTP stack with the stand-in engine of `test_responses_api` (the tiny llama
tokenizer with a Qwen-style template): errors name the client's own fields, the internal
prefill switch is no wire field, and the per-request steps (n check, thinking budget,
grammar compilation, prompt rendering) each run once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_responses_api import make_app, prompts, run

from mlxcel.engine.chat.template import ChatTemplate
from mlxcel.server.chat.request import ChatOptions
from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
from mlxcel.server.sampling_fields import SamplingFields

IMAGE = "data:image/png;base64,iVBORw0KGgo="
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def call(_: Any, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, json=body)

    return run(app, call)  # type: ignore[no-any-return]


def _error(answer: httpx.Response) -> dict[str, Any]:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert isinstance(error, dict)
    return error


# ---------------------------------------------------------------- field names


def test_responses_content_error_names_the_input_item(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["x"])
    parts = [{"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": IMAGE}]
    body = {
        "model": "m",
        "instructions": "Be brief.",  # a system turn first: chat's index would be off by one
        "input": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": parts},
        ],
    }
    error = _error(_post(app, "/v1/responses", body))
    assert error["message"].startswith("input[2].content:"), error
    assert "messages" not in error["message"]
    assert engine.requests == []


def test_responses_sampling_error_names_the_responses_field(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["x"])
    error = _error(_post(app, "/v1/responses", {"model": "m", "input": "hi", "top_k": "many"}))
    assert error["message"].startswith("top_k:") and error["param"] == "top_k"


def test_chat_content_error_names_the_message(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["x"])
    parts = [{"type": "image_url", "image_url": {"url": IMAGE}}]
    body = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": parts}]}
    error = _error(_post(app, "/v1/chat/completions", body))
    assert error["message"].startswith("messages[1].content:"), error


def test_messages_errors_name_the_anthropic_fields(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["x"])
    user = [{"role": "user", "content": "hi"}]
    bad_knob = {"model": "m", "max_tokens": 5, "messages": user, "min_p": "lots"}
    error = _error(_post(app, "/v1/messages", bad_knob))
    assert "min_p" in error["message"]
    image = {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}}
    blocks = [{"role": "user", "content": [{"type": "text", "text": "a"}, image]}]
    error = _error(_post(app, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": blocks}))
    assert "messages[0].content[1]" in error["message"]
    assert engine.requests == []


# ---------------------------------------------------------------- prefill switch


def test_prefill_assistant_is_not_a_request_field(hf_tokenizer: Any) -> None:
    assert "prefill_assistant" not in ChatCompletionRequest.model_fields
    assert "prefill_assistant" not in ChatOptions.model_fields
    app, engine = make_app(hf_tokenizer, ["x"])
    messages = [
        {"role": "user", "content": "Tell a story"},
        {"role": "assistant", "content": "Once upon"},
    ]
    body = {"messages": messages, "prefill_assistant": False}  # ignored, as unknown fields are
    answer = _post(app, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    prompt = prompts(hf_tokenizer, engine)[0]
    assert prompt.endswith("Once upon"), prompt  # continued, as llama-server does


# ---------------------------------------------------------------- once per request


class Counts:
    """How often each per-request step ran."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1


class _Backend:
    """A grammar engine that only counts its compilations."""

    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def compile_json_schema(self, schema: Any) -> object:
        self.counts.count("compile")
        return object()


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    import mlxcel.engine.grammar as grammar

    counts = Counts()

    def spy(name: str, method: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            counts.count(name)
            return method(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(SamplingFields, "check_n", spy("check_n", SamplingFields.check_n))
    monkeypatch.setattr(
        ChatOptions, "thinking_budget", spy("thinking_budget", ChatOptions.thinking_budget)
    )
    monkeypatch.setattr(ChatTemplate, "render", spy("render", ChatTemplate.render))
    monkeypatch.setattr(grammar, "get_grammar_backend", lambda *_: _Backend(counts))
    yield counts


FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
REQUESTS = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": FORMAT},
    ),
    "responses": (
        "/v1/responses",
        {
            "model": "m",
            "input": "hi",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}},
        },
    ),
    "messages": (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    ),
}


@pytest.mark.parametrize("family", list(REQUESTS))
def test_each_step_runs_once_per_request(family: str, hf_tokenizer: Any, counts: Counts) -> None:
    path, body = REQUESTS[family]
    app, engine = make_app(hf_tokenizer, ["{}"])
    answer = _post(app, path, body)
    assert answer.status_code == 200, answer.text
    assert len(engine.requests) == 1 and engine.requests[0].grammar is not None
    assert counts.calls == {"check_n": 1, "thinking_budget": 1, "compile": 1, "render": 1}


def test_context_management_renders_the_prompt_once(hf_tokenizer: Any, counts: Counts) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])
    body = {
        "model": "m",
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}},
        "context_management": [{"type": "compaction", "compact_threshold": 100000}],
    }
    answer = _post(app, "/v1/responses", body)
    assert answer.status_code == 200, answer.text
    assert len(engine.requests) == 1
    assert counts.calls == {"check_n": 1, "thinking_budget": 1, "compile": 1, "render": 1}
