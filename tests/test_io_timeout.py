"""`-to/--timeout`: a client that stalls reading or writing is dropped; slow answers are not."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import pytest
from fixtures.asgi import body_then_wait, json_post, stand_in_app
from fixtures.stand_in_engine import StandInEngine

from mlxcel.engine.text.request import GenerationEvent


class SlowEngine(StandInEngine):
    """Answers "Hi" at once, then finishes after `finish_after` seconds (from a thread)."""

    def __init__(self, finish_after: float) -> None:
        self.finish_after = finish_after
        self.requests: list[str] = []
        self.cancelled: list[str] = []

    def submit(self, request: Any, sink: Any) -> None:
        rid = request.request_id
        self.requests.append(rid)
        sink(GenerationEvent(rid, text="Hi", token_ids=(10,)))

        def finish() -> None:
            time.sleep(self.finish_after)
            if rid not in self.cancelled:
                sink(
                    GenerationEvent(rid, finish_reason="stop", prompt_tokens=3, completion_tokens=1)
                )

        threading.Thread(target=finish, daemon=True).start()

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def _chat(stream: bool) -> tuple[dict[str, Any], bytes]:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "Hello"}]}
    return json_post("/v1/chat/completions", body)


def _call(app: Any, scope: dict[str, Any], receive: Any, send: Any, limit: float) -> float:
    """Run one ASGI request; its wall time (it must end within `limit` seconds)."""

    async def go() -> None:
        await asyncio.wait_for(app(scope, receive, send), limit)

    start = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - start


def test_a_client_that_stops_reading_is_dropped(hf_tokenizer: Any) -> None:
    engine = SlowEngine(finish_after=30.0)
    app, _ = stand_in_app(hf_tokenizer, engine, timeout=1)
    scope, payload = _chat(stream=True)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # the client's receive window stays full

    took = _call(app, scope, body_then_wait(payload), send, limit=10)
    assert took < 5
    assert engine.requests and engine.cancelled == engine.requests


def test_a_slow_reader_that_keeps_reading_is_not_dropped(hf_tokenizer: Any) -> None:
    """Each write may take up to `--timeout`: writes of 0.6 s each under `--timeout 1`,
    three seconds in all, finish the stream (the check times each write, not the stream)."""
    engine = SlowEngine(finish_after=1.5)
    app, _ = stand_in_app(hf_tokenizer, engine, timeout=1)
    scope, payload = _chat(stream=True)
    bodies: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.6)  # the client reads, slowly
            bodies.append(message.get("body", b""))

    took = _call(app, scope, body_then_wait(payload), send, limit=20)
    assert took >= 1.5
    assert engine.cancelled == []
    assert b"data: [DONE]" in b"".join(bodies)


def test_a_client_that_stops_reading_mid_stream_is_dropped(hf_tokenizer: Any) -> None:
    """Writes that go through at once, then one that never does: dropped after about
    `--timeout` from that write, the request cancelled."""
    engine = SlowEngine(finish_after=0.3)
    app, _ = stand_in_app(hf_tokenizer, engine, timeout=1)
    scope, payload = _chat(stream=True)
    writes = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal writes
        if message["type"] == "http.response.body":
            writes += 1
            if writes == 2:  # the first chunk went out; the window is full from here
                await asyncio.sleep(3600)

    took = _call(app, scope, body_then_wait(payload), send, limit=10)
    assert 1.0 <= took < 5
    assert writes == 2


def test_a_client_that_stalls_sending_its_body_is_dropped(hf_tokenizer: Any) -> None:
    engine = SlowEngine(finish_after=0.0)
    app, _ = stand_in_app(hf_tokenizer, engine, timeout=1)
    scope, _ = _chat(stream=False)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # announces a body, never sends it
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    took = _call(app, scope, receive, send, limit=10)
    assert took < 5
    assert engine.requests == []
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["type"] == "invalid_request_error"
    assert "sent nothing for 1 s" in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_answer_is_not_a_timeout(hf_tokenizer: Any, stream: bool) -> None:
    """Waiting for the engine is neither a read nor a write: a 2 s answer under
    `--timeout 1` completes."""
    engine = SlowEngine(finish_after=2.0)
    app, _ = stand_in_app(hf_tokenizer, engine, timeout=1)
    scope, payload = _chat(stream=stream)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    took = _call(app, scope, body_then_wait(payload), send, limit=20)
    assert took >= 1.9
    assert sent[0]["status"] == 200
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"Hi" in body
    assert engine.cancelled == []


def test_a_real_server_answers_a_stalled_body_with_408_and_stays_up(
    tiny_llama_dir: Any,
) -> None:
    """Through `mlxcel serve --timeout 1`: a request whose body never arrives gets a 408 in
    the OpenAI error shape after about a second, one warning line, and the server serves on."""
    from urllib.parse import urlsplit

    from server_harness import ServeProcess

    with ServeProcess(["-m", str(tiny_llama_dir), "--timeout", "1"]) as server:
        address = urlsplit(server.url)
        assert address.hostname and address.port
        with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model":'
            )
            start = time.perf_counter()
            reply = b""
            while b"}}" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            took = time.perf_counter() - start
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b'"type":"invalid_request_error"' in body.replace(b" ", b"")
        assert 0.5 < took < 5
        with server.client(timeout=30) as client:
            assert client.get("/health").status_code == 200
        logs = server.stderr
    assert "(--timeout)" in logs
    assert "Traceback" not in logs and "ERROR" not in logs
