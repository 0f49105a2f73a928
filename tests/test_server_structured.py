"""Structured output through the real server: `response_format: json_schema` always validates."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
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


def test_json_object_and_oversized_schemas_are_400(client: OpenAI, http: httpx.Client) -> None:
    with pytest.raises(BadRequestError):
        client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            response_format={"type": "json_object"},  # type: ignore[arg-type]
        )
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


def test_native_completion_accepts_only_text_format(http: httpx.Client) -> None:
    ok = http.post(
        "/completion", json={"prompt": "a", "n_predict": 2, "response_format": {"type": "text"}}
    )
    assert ok.status_code == 200
    bad = http.post("/completion", json={"prompt": "a", "n_predict": 2, "response_format": FORMAT})
    assert bad.status_code == 400
