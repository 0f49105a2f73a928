"""Structured output through the real server: `response_format: json_schema` always validates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from server_harness import API_KEY, AUTH, main_server_args, shared_server

SCHEMA = {
    "type": "object",
    "properties": {
        "animal": {"type": "string", "maxLength": 12},
        "habitat": {"type": "string", "enum": ["forest", "desert", "ocean", "urban"]},
        "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    },
    "required": ["animal", "habitat", "legs"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "Animal", "strict": True, "schema": SCHEMA},
}
MESSAGES = [{"role": "user", "content": "Name an animal and its habitat."}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> OpenAI:
    server = shared_server(main_server_args(tiny_llama_dir))
    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(tiny_llama_dir: Path) -> httpx.Client:
    server = shared_server(main_server_args(tiny_llama_dir))
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=120)


def test_chat_json_schema_output_validates_for_50_seeds(client: OpenAI) -> None:
    """The random-weight model, sampled hot: every one of 50 answers parses and validates."""

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=FORMAT,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(50)))
    for out in answers:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert len({a.choices[0].message.content for a in answers}) > 10  # really sampled


def test_streamed_json_schema_output_validates(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=FORMAT,  # type: ignore[arg-type]
        temperature=0.7,
        seed=3,
        max_tokens=120,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_json_schema_output_validates(http: httpx.Client) -> None:
    out = http.post(
        "/v1/completions",
        json={"prompt": "JSON:", "response_format": FORMAT, "max_tokens": 120, "seed": 1},
    )
    assert out.status_code == 200, out.text
    jsonschema.validate(json.loads(out.json()["choices"][0]["text"]), SCHEMA)


JSON_OBJECT = {"type": "json_object"}


def test_chat_json_object_output_is_one_object_over_12_seeds(client: OpenAI) -> None:
    """`json_object` (OpenAI's JSON mode) through the openai SDK: any JSON object, and only
    one, from the random-weight model sampled hot (its keys are random strings, so a few
    answers run to max_tokens; every answer that ends is an object)."""

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format=JSON_OBJECT,  # type: ignore[arg-type]
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(ask, range(12)))
    ended = [c for c in choices if c.finish_reason == "stop"]
    assert len(ended) >= 6, [c.finish_reason for c in choices]
    for choice in ended:
        assert isinstance(json.loads(choice.message.content or ""), dict), choice
    for choice in choices:
        assert (choice.message.content or "").lstrip().startswith("{"), choice


def test_json_object_on_completions_responses_and_streams(
    client: OpenAI, http: httpx.Client
) -> None:
    text = client.completions.create(
        model="m",
        prompt="JSON:",
        max_tokens=400,
        seed=10,
        extra_body={"response_format": JSON_OBJECT},
    ).choices[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict), text
    answer = client.responses.create(
        model="m",
        input="JSON please",
        text={"format": JSON_OBJECT},  # type: ignore[typeddict-item]
        temperature=1.0,
        max_output_tokens=400,
        extra_body={"seed": 10},
    )
    assert answer.status == "completed" and isinstance(json.loads(answer.output_text), dict)
    stream = client.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=JSON_OBJECT,  # type: ignore[arg-type]
        temperature=1.0,
        seed=10,
        max_tokens=400,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(streamed), dict), streamed
    # llama-server's extension: a schema beside the type constrains to it
    fmt = {"type": "json_object", "schema": {"type": "array", "items": {"type": "integer"}}}
    out = http.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "response_format": fmt, "max_tokens": 200, "seed": 1},
    )
    assert out.status_code == 200, out.text
    assert isinstance(json.loads(out.json()["choices"][0]["message"]["content"]), list)
    bad = {"type": "json_object", "schema": 123}
    out = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": bad})
    assert out.status_code == 400 and "json_object" in out.json()["error"]["message"]


def test_oversized_schemas_are_400(http: httpx.Client) -> None:
    # The 64 KiB size limit is covered in test_grammar.py: this server caps bodies at 64 KiB.
    refs = {
        "$defs": {"s": {"type": "string", "description": "x" * 40}},
        "type": "object",
        "properties": {f"p{i}": {"$ref": "#/$defs/s"} for i in range(70)},
    }
    deep: dict[str, object] = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    for schema in (refs, deep):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        out = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": fmt})
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert (
            "xxxxxxxx" not in error["message"]
            and "#/$defs" not in error["message"]
            and len(error["message"]) < 300
        )


def test_forced_tool_choice_with_schema_is_400(http: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    out = http.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": tools,
            "tool_choice": "required",
            "response_format": FORMAT,
        },
    )
    assert out.status_code == 400
    assert "tool_choice" in out.json()["error"]["message"]


def test_native_completion_takes_json_object_and_json_schema(http: httpx.Client) -> None:
    """llama-server's `/completion`: its `json_schema` field, and a response_format as on
    the OpenAI routes."""
    ok = http.post(
        "/completion", json={"prompt": "a", "n_predict": 2, "response_format": {"type": "text"}}
    )
    assert ok.status_code == 200
    base = {"prompt": "JSON:", "n_predict": 400, "seed": 4}
    for extra in ({"response_format": FORMAT}, {"json_schema": SCHEMA}):
        out = http.post("/completion", json={**base, **extra})
        assert out.status_code == 200, out.text
        jsonschema.validate(json.loads(out.json()["content"]), SCHEMA)
    out = http.post("/completion", json={**base, "response_format": JSON_OBJECT})
    assert isinstance(json.loads(out.json()["content"]), dict), out.text
    both = {**base, "response_format": JSON_OBJECT, "json_schema": SCHEMA}
    assert http.post("/completion", json=both).status_code == 400


def test_logprobs_under_a_grammar_are_json_numbers(http: httpx.Client) -> None:
    # Tokens the grammar rules out have no log-probability: they are left out of
    # top_logprobs (was a 500: -inf is no JSON number), streamed and not.
    for stream in (False, True):
        body = {
            "messages": MESSAGES,
            "response_format": JSON_OBJECT,
            "logprobs": True,
            "top_logprobs": 5,
            "max_tokens": 24,
            "seed": 3,
            "stream": stream,
        }
        out = http.post("/v1/chat/completions", json=body)
        assert out.status_code == 200, out.text
        if stream:
            chunks = [
                json.loads(line[6:])
                for line in out.text.splitlines()
                if line.startswith("data: {")  # json.loads would take -Infinity
            ]
            contents = [
                item
                for chunk in chunks
                for choice in chunk["choices"]
                if choice.get("logprobs")
                for item in choice["logprobs"]["content"]
            ]
        else:
            contents = out.json()["choices"][0]["logprobs"]["content"]
        assert contents
        assert any(len(item["top_logprobs"]) < 5 for item in contents)  # forced steps
        for item in contents:
            assert -9999.0 <= item["logprob"] <= 0.0
            assert all(-1e9 < alt["logprob"] <= 0.0 for alt in item["top_logprobs"])
            assert "Infinity" not in json.dumps(item)
