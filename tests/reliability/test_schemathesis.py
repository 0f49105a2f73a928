"""Schemathesis over the app's OpenAPI document, in-process (ASGI), on the tiny model.

Every route, every documented body: the generation routes read their JSON themselves, so
their request models (the ones the routes validate with) are written into the document
here. Checks: no unexpected 5xx (501 "not served here" and 503 backpressure are expected
answers), every 4xx in its route family's error shape (Anthropic on /v1/messages, OpenAI
elsewhere); with an API key, every route but /health and / answers 401 without it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel
from schemathesis import GenerationMode

from mlxcel.config import Settings
from mlxcel.server.app import KEYLESS_ROUTES, PUBLIC_ROUTES, create_app
from mlxcel.server.state import ServerState

MAX_EXAMPLES = int(os.environ.get("MLXCEL_FUZZ_EXAMPLES", "3"))
EXPECTED_5XX = {501, 503}
PUBLIC = {*PUBLIC_ROUTES, *KEYLESS_ROUTES}
"""Paths that answer without the API key (`/models` and `/v1/models`: public in llama-server)."""


def _request_models() -> dict[str, type[BaseModel]]:
    from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
    from mlxcel.server.llama_native.protocol import (
        DetokenizeRequest,
        InfillRequest,
        NativeCompletionRequest,
        TokenizeRequest,
    )
    from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
    from mlxcel.server.openai_completions.protocol import CompletionRequest
    from mlxcel.server.openai_responses.protocol import ResponsesRequest

    models: dict[str, type[BaseModel]] = {
        "/completion": NativeCompletionRequest,
        "/completions": NativeCompletionRequest,
        "/infill": InfillRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
        "/apply-template": ChatCompletionRequest,
    }
    for prefix in ("", "/v1"):
        models[f"{prefix}/chat/completions"] = ChatCompletionRequest
        models[f"{prefix}/chat/completions/input_tokens"] = ChatCompletionRequest
        models[f"{prefix}/responses"] = ResponsesRequest
        models[f"{prefix}/responses/input_tokens"] = ResponsesRequest
        models[f"{prefix}/responses/compact"] = ResponsesRequest
        models[f"{prefix}/messages"] = MessagesRequest
        models[f"{prefix}/messages/count_tokens"] = CountTokensRequest
    models["/v1/completions"] = CompletionRequest
    return models


def documented(app: Any) -> dict[str, Any]:
    """The app's OpenAPI document with the generation routes' request bodies filled in."""
    raw = app.openapi()
    components = raw.setdefault("components", {}).setdefault("schemas", {})
    for path, model in _request_models().items():
        operation = raw["paths"].get(path, {}).get("post")
        if operation is None:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    return raw


@pytest.fixture(scope="module")
def app(tiny_llama_dir: Path) -> Iterator[Any]:
    from mlxcel.server.boot import load_into

    state = ServerState(
        settings=Settings(model=str(tiny_llama_dir), warmup=False, parallel=2, ctx_size=512)
    )
    load_into(state)
    yield create_app(state)
    assert state.client is not None
    state.client.engine.stop()
    if state.embeddings is not None:
        state.embeddings.stop()


def is_messages(path: str) -> bool:
    return re.fullmatch(r"(/v1)?/messages(/count_tokens)?", path) is not None


def assert_error_shape(path: str, status: int, body: Any) -> None:
    """The route family's error shape: Anthropic's on the Messages routes, OpenAI's else."""
    assert isinstance(body, dict), (path, status, body)
    if is_messages(path):
        assert body.get("type") == "error", (path, status, body)
        error = body.get("error")
        assert isinstance(error, dict) and isinstance(error.get("type"), str), body
    else:
        error = body.get("error")
        assert isinstance(error, dict), (path, status, body)
        assert isinstance(error.get("type"), str) and error["type"], body
    assert isinstance(error.get("message"), str) and error["message"], body
    assert "Traceback" not in error["message"]


_ALIASES = {"/v1/completions": "/v1/completions", "/completions": "/completion"}
"""Paths whose handler is not the one of the path without `/v1`."""


def _operations(*, aliases: bool) -> list[str]:
    """`METHOD /path` of every documented operation (from an app with nothing loaded).

    Without `aliases`, a route served under several paths (`/chat/completions` and
    `/v1/chat/completions`, `/completion` and `/completions`, ...) is taken once.
    """
    app = create_app(ServerState(settings=Settings(warmup=False)))
    labels: list[str] = []
    seen: set[Any] = set()
    for path, operations in documented(app)["paths"].items():
        if re.match(r"^/(v1/)?audio/", path):
            continue  # no audio model here: those routes answer 501 (tests/test_audio_http.py)
        for method in operations:
            key = (method, _ALIASES.get(path, re.sub(r"^/v1(?=/)", "", path)))
            if aliases or key not in seen:
                labels.append(f"{method.upper()} {path}")
            seen.add(key)
    return labels


def _has_inputs(label: str) -> bool:
    """Negative cases need something to break: a documented body (any path string is valid)."""
    method, path = label.split(" ", 1)
    operation = _DOCUMENTED["paths"][path][method.lower()]
    return "requestBody" in operation or any(
        p.get("in") == "query" for p in operation.get("parameters", [])
    )


_DOCUMENTED = documented(create_app(ServerState(settings=Settings(warmup=False))))
CASES = [
    pytest.param(label, mode, id=f"{mode.value}-{label}")
    for label in _operations(aliases=False)
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or _has_inputs(label)
]
ALIAS_CASES = [
    pytest.param(label, mode, id=f"{mode.value}-{label}", marks=pytest.mark.soak)
    for label in sorted(set(_operations(aliases=True)) - set(_operations(aliases=False)))
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE or _has_inputs(label)
]


@pytest.fixture(scope="module")
def api_schema(app: Any) -> Any:
    schema = schemathesis.openapi.from_dict(documented(app))
    schema.app = app
    return schema


def _bounded(case: Any) -> None:
    if not isinstance(case.body, dict):
        return
    case.body.pop("stream", None)  # streamed answers: test_hostile_bodies
    for key in ("max_tokens", "n_predict", "max_output_tokens", "max_completion_tokens"):
        if isinstance(case.body.get(key), int) and case.body[key] > 8:
            case.body[key] = 8  # bounded generation: this test is about the protocol


@pytest.mark.parametrize(("label", "mode"), CASES + ALIAS_CASES)
def test_no_unexpected_5xx_and_errors_in_the_family_shape(
    api_schema: Any, label: str, mode: GenerationMode
) -> None:
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    seen: list[int] = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        _bounded(case)
        response = case.call()
        status = response.status_code
        seen.append(status)
        assert status < 500 or status in EXPECTED_5XX, (
            label,
            status,
            response.text[:300],
        )
        if status >= 400:
            assert_error_shape(path, status, response.json())

    check()
    assert seen, label


def test_with_an_api_key_every_route_but_health_answers_401(tiny_llama_dir: Path) -> None:
    state = ServerState(
        settings=Settings(model=str(tiny_llama_dir), warmup=False, api_key=["sk-secret"])
    )
    app = create_app(state)  # the model need not load: authentication comes first
    raw = documented(app)
    checked = 0
    with TestClient(app) as client:
        for path, operations in raw["paths"].items():
            url = re.sub(r"\{[^}]+\}", "x", path)
            for method in operations:
                response = client.request(method.upper(), url, json={})
                if path in PUBLIC:
                    assert response.status_code != 401, (method, path)
                    continue
                assert response.status_code == 401, (method, path, response.status_code)
                assert_error_shape(path, 401, response.json())
                checked += 1
    assert checked >= 40
