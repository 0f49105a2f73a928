"""SSE responses run their `on_close` however they end, even before the first chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fixtures.asgi import body_then_wait, json_post, stand_in_app
from fixtures.stand_in_engine import StandInEngine
from starlette.requests import ClientDisconnect

from mlxcel.server.sse import event_stream


def _scope() -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "GET"}


async def _receive() -> dict[str, Any]:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


def test_on_close_runs_when_the_client_is_gone_before_the_first_chunk() -> None:
    started: list[bool] = []
    closed: list[bool] = []

    async def body() -> AsyncIterator[str]:
        started.append(True)  # never reached: the response start already failed
        yield "data: x\n\n"

    async def send(message: dict[str, Any]) -> None:
        raise OSError("client disconnected")

    response = event_stream(body(), on_close=lambda: closed.append(True))
    with pytest.raises((OSError, ClientDisconnect)):  # Starlette may rename it
        asyncio.run(response(_scope(), _receive, send))
    assert closed == [True]
    assert started == []


def test_on_close_runs_after_a_complete_stream() -> None:
    sent: list[dict[str, Any]] = []
    closed: list[bool] = []

    async def body() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    response = event_stream(body(), on_close=lambda: closed.append(True))
    asyncio.run(response(_scope(), _receive, send))
    assert closed == [True]
    chunks = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")


# ----------------------------------------------------------- through the real routes


class HoldingEngine(StandInEngine):
    """Admits every request with one token, then holds it open (never finishes)."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.cancelled: list[str] = []

    def submit(self, request: Any, sink: Any) -> None:
        from mlxcel.engine.text.request import GenerationEvent

        self.requests.append(request.request_id)
        sink(GenerationEvent(request.request_id, text="Hi", token_ids=(10,)))

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


STREAMING_CALLS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/completions", {"prompt": "Hello"}),
    ("/completion", {"prompt": "Hello"}),
    ("/v1/responses", {"input": "Hello"}),
    ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}),
]


@pytest.mark.parametrize(("path", "body"), STREAMING_CALLS, ids=[p for p, _ in STREAMING_CALLS])
def test_a_client_gone_before_the_first_chunk_frees_its_slot(
    hf_tokenizer: Any, path: str, body: dict[str, Any]
) -> None:
    from mlxcel.server.openai_responses.store import stores_for

    engine = HoldingEngine()
    app, state = stand_in_app(hf_tokenizer, engine)
    scope, payload = json_post(path, {"model": "m", "stream": True, **body})
    receive = body_then_wait(payload)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
            raise OSError("client disconnected")

    async def call() -> None:
        with contextlib.suppress(Exception):
            await app(scope, receive, send)

    asyncio.run(call())
    assert engine.requests, "the request never reached the engine"
    assert engine.cancelled == engine.requests
    if path == "/v1/responses":
        entries = stores_for(app, state.settings).responses._entries.values()
        assert [stored.response["status"] for _, stored in entries] == ["cancelled"]
