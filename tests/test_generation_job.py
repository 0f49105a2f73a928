"""One generation path on all five API families: counting, mid-stream errors, cancel.

The real HTTP app runs in front of a scripted stand-in engine; each family is driven as a
client would (JSON and SSE), and `/metrics` must equal what the answers themselves said.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fixtures.asgi import json_post, stand_in_app
from fixtures.stand_in_engine import StandInEngine
from sse_reader import sse_events

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings

USER = [{"role": "user", "content": "Hello"}]

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER}),
    "completions": ("/v1/completions", {"prompt": "Hello"}),
    "native": ("/completion", {"prompt": "Hello"}),
    "responses": ("/v1/responses", {"input": "Hello"}),
    "messages": ("/v1/messages", {"max_tokens": 8, "messages": USER}),
}


class ScriptedEngine(StandInEngine):
    """Every request gets `tokens` (one event each), then a final event.

    The final event finishes with `finish` (an `error` carries `error`); its timings say
    that `cached` prompt tokens came from the cache. With `hold`, no final event comes:
    the request stays open until cancelled.
    """

    def __init__(
        self,
        tokens: list[str],
        *,
        finish: str = "stop",
        error: str | None = None,
        cached: int = 1,
        hold: bool = False,
    ) -> None:
        self.tokens = tokens
        self.finish = finish
        self.error = error
        self.cached = cached
        self.hold = hold
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        self.requests.append(request)
        rid = request.request_id
        for i, text in enumerate(self.tokens):
            sink(GenerationEvent(rid, text=text, token_ids=(20 + i,)))
        if self.hold:
            return
        n_prompt = len(request.prompt_tokens)
        timings = Timings(
            prompt_n=n_prompt - self.cached,
            prompt_ms=4.0,
            predicted_n=len(self.tokens),
            predicted_ms=8.0,
            cache_n=self.cached,
        )
        sink(
            GenerationEvent(
                rid,
                finish_reason=self.finish,  # type: ignore[arg-type]
                prompt_tokens=n_prompt,
                completion_tokens=len(self.tokens),
                timings=timings,
                error=self.error,
            )
        )

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def _post_all(app: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post(path, json=body) for path, body in calls]

    return asyncio.run(go())


def _get(app: Any, path: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get(path)

    return asyncio.run(go())


def _sse(text: str) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every SSE message with JSON data."""
    return [(e.name, e.json()) for e in sse_events(text) if e.data.startswith("{")]


def _metrics(app: Any) -> dict[str, float]:
    text = _get(app, "/metrics").text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _reported(family: str, stream: bool, response: httpx.Response) -> tuple[int, int]:
    """(prompt tokens, completion tokens) as the answer itself reports them."""
    assert response.status_code == 200, response.text
    if not stream:
        body = response.json()
        if family in ("chat", "completions"):
            return body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
        if family == "native":
            return body["tokens_evaluated"], body["tokens_predicted"]
        usage = body["usage"]
        if family == "messages":  # Anthropic's input_tokens leave out the cache reads
            return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"]
        return usage["input_tokens"], usage["output_tokens"]
    events = _sse(response.text)
    if family in ("chat", "completions"):
        (usage,) = [data["usage"] for _, data in events if data.get("usage")]
        return usage["prompt_tokens"], usage["completion_tokens"]
    if family == "native":
        (last,) = [data for _, data in events if data.get("stop")]
        return last["tokens_evaluated"], last["tokens_predicted"]
    if family == "responses":
        (done,) = [data for name, data in events if name == "response.completed"]
        usage = done["response"]["usage"]
        return usage["input_tokens"], usage["output_tokens"]
    (delta,) = [data for name, data in events if name == "message_delta"]
    usage = delta["usage"]
    return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"]


def _stream_body(family: str, body: dict[str, Any]) -> dict[str, Any]:
    out = {"model": "m", "stream": True, **body}
    if family in ("chat", "completions"):
        out["stream_options"] = {"include_usage": True}
    return out


def test_metrics_equal_the_summed_usage_of_every_family(hf_tokenizer: Any) -> None:
    engine = ScriptedEngine(["Hel", "lo", "!"], cached=2)
    app, _ = _app(hf_tokenizer, engine)
    before = _metrics(app)
    calls: list[tuple[str, bool, tuple[str, dict[str, Any]]]] = []
    for family, (path, body) in FAMILIES.items():
        calls.append((family, False, (path, {"model": "m", **body})))
        calls.append((family, True, (path, _stream_body(family, body))))
    responses = _post_all(app, [call for _, _, call in calls])
    reported = [_reported(f, s, r) for (f, s, _), r in zip(calls, responses, strict=True)]
    after = _metrics(app)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert len(engine.requests) == 10
    assert moved("mlxcel_requests_total") == 10
    assert moved("mlxcel_prompt_tokens_total") == sum(p for p, _ in reported)
    assert moved("mlxcel_completion_tokens_total") == sum(c for _, c in reported) == 30
    # llama-server's own: prompt tokens without the cached ones, and the cached ones.
    assert moved("llamacpp:prompt_tokens_total") == sum(p - 2 for p, _ in reported)
    assert moved("llamacpp:prompt_tokens_cache_total") == 2 * 10
    assert moved("llamacpp:tokens_predicted_total") == 30
    assert moved("llamacpp:prompt_seconds_total") == pytest.approx(10 * 0.004)
    assert moved("llamacpp:tokens_predicted_seconds_total") == pytest.approx(10 * 0.008)


def _app(hf_tokenizer: Any, engine: Any) -> tuple[Any, Any]:
    return stand_in_app(hf_tokenizer, engine, metrics=True)


def _error_surfaced(family: str, text: str) -> dict[str, Any]:
    """The error a mid-stream failure sent, in the family's own convention."""
    events = _sse(text)
    if family in ("chat", "completions"):
        *_, finish, error = [data for _, data in events]
        assert finish["choices"][0]["finish_reason"] == "error"
        assert text.endswith("data: [DONE]\n\n")
        assert error["error"]["type"] == "server_error"
        return dict(error["error"])
    if family == "native":
        last = events[-1][1]
        assert set(last) == {"error"} and last["error"]["type"] == "server_error"
        return dict(last["error"])
    if family == "responses":
        name, last = events[-1]
        assert name == "response.failed" and last["response"]["status"] == "failed"
        return dict(last["response"]["error"])
    name, last = events[-1]
    assert name == "error" and last["error"]["type"] == "api_error"
    return dict(last["error"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_mid_stream_engine_error_surfaces_the_api_way(hf_tokenizer: Any, family: str) -> None:
    engine = ScriptedEngine(["Hel", "lo"], finish="error", error="boom reading /secret/dir/w.bin")
    app, _ = _app(hf_tokenizer, engine)
    path, body = FAMILIES[family]
    streamed, plain = _post_all(
        app, [(path, _stream_body(family, body)), (path, {"model": "m", **body})]
    )
    assert streamed.status_code == 200  # the stream had started when the engine failed
    error = _error_surfaced(family, streamed.text)
    assert "generation failed: boom" in error["message"]
    assert "/secret" not in error["message"] and "<path>" in error["message"]
    # Not streamed: a 500 in the family's error shape, the same message.
    assert plain.status_code == 500
    wire = plain.json()["error"]
    assert wire["message"] == error["message"]
    assert wire["type"] == ("api_error" if family == "messages" else "server_error")
    # A failed request is not counted.
    assert _metrics(app)["mlxcel_requests_total"] == 0


def _drive(app: Any, path: str, body: dict[str, Any], gone: Callable[[list[Any]], bool]) -> None:
    """POST `body`; the client disconnects as soon as `gone(messages sent so far)`."""
    scope, payload = json_post(path, body)
    sent: list[Any] = []
    delivered = False
    wake = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        while not gone(sent):
            wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), 0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone(sent):
            raise OSError("client disconnected")
        sent.append(message)
        wake.set()

    async def call() -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(app(scope, receive, send), 10)

    asyncio.run(call())


def _got_a_data_chunk(sent: list[Any]) -> bool:
    return any(m["type"] == "http.response.body" and b"data: " in m.get("body", b"") for m in sent)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "collected"])
def test_a_client_gone_mid_answer_cancels_its_request(
    hf_tokenizer: Any, family: str, stream: bool
) -> None:
    engine = ScriptedEngine(["Hi"], hold=True)
    app, _ = _app(hf_tokenizer, engine)
    path, body = FAMILIES[family]
    payload = _stream_body(family, body) if stream else {"model": "m", **body}
    # Streamed: gone after the first chunk; collected: gone while waiting for the body.
    _drive(app, path, payload, _got_a_data_chunk if stream else (lambda sent: True))
    assert [r.request_id for r in engine.requests] == engine.cancelled != []
    assert _metrics(app)["mlxcel_requests_total"] == 0
