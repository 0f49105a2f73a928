"""GET /v1/models and /v1/models/{id} through the official `openai` and `anthropic` SDKs.

The first tests run the real HTTP stack without a socket (a stand-in engine, a model named
`tiny-llama` served as `--alias local,fim`); the last drives a real `mlxcel serve`.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic import Anthropic, AsyncAnthropic
from fixtures.stand_in_engine import StandInEngine
from openai import AsyncOpenAI, OpenAI
from server_harness import API_KEY, main_server_args, shared_server
from test_responses_api import run

from mlxcel.config import Settings
from mlxcel.engine.loading.model import ModelInfo
from mlxcel.server.app import create_app
from mlxcel.server.bridge import EngineClient
from mlxcel.server.state import ServerState


def make_app() -> Any:
    state = ServerState(settings=Settings(warmup=False, alias="local,fim"))
    state.model_info = ModelInfo(
        name="tiny-llama", source="mlx", path=Path("/m"), architecture="llama", context_length=64
    )
    state.client = EngineClient(StandInEngine())
    return create_app(state)


def with_anthropic(app: Any, call: Any) -> Any:
    async def go() -> Any:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
            client = AsyncAnthropic(
                api_key="x", base_url="http://t", http_client=http, max_retries=0
            )
            return await call(client, http)

    return asyncio.run(go())


def test_openai_retrieve_by_id_and_alias_and_404() -> None:
    app = make_app()

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        listed = [m async for m in client.models.list()]
        assert [m.id for m in listed] == ["fim"]
        for name in ("fim", "local", "tiny-llama"):
            model = await client.models.retrieve(name)
            assert model.model_dump() == listed[0].model_dump()
        assert (await http.get("/models/local")).json()["id"] == "fim"  # the alias without /v1
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve("gpt-4o")
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "model_not_found"
        assert caught.value.body["type"] == "invalid_request_error"
        assert "gpt-4o" in caught.value.body["message"]
        nested = await http.get("/v1/models/org/other")  # ids with a slash reach the route
        assert nested.status_code == 404 and nested.json()["error"]["code"] == "model_not_found"

    run(app, call)


def test_anthropic_shape_with_the_version_header() -> None:
    app = make_app()

    async def call(client: AsyncAnthropic, http: httpx2.AsyncClient) -> None:
        page = await client.models.list()
        (model,) = page.data
        assert (model.type, model.id, model.display_name) == ("model", "fim", "tiny-llama")
        assert isinstance(model.created_at, datetime) and model.created_at.tzinfo is not None
        raw = (await http.get("/v1/models", headers={"anthropic-version": "2023-06-01"})).json()
        assert raw["has_more"] is False and raw["first_id"] == raw["last_id"] == "fim"
        assert raw["data"][0]["created_at"].endswith("Z") and "object" not in raw["data"][0]
        got = await client.models.retrieve("local")
        assert got.model_dump() == model.model_dump()
        with pytest.raises(anthropic.NotFoundError) as caught:
            await client.models.retrieve("claude-sonnet-4-5")
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "not_found_error"

    with_anthropic(app, call)


def test_real_server_both_sdks(tiny_llama_dir: Path) -> None:
    server = shared_server(main_server_args(tiny_llama_dir))
    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    (listed,) = client.models.list().data
    assert client.models.retrieve(listed.id).id == listed.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    claude = Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    (model,) = claude.models.list().data
    assert model.id == listed.id and model.type == "model"
    assert claude.models.retrieve(model.id).display_name == model.display_name
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("no-such-model")
