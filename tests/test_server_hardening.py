"""Hardening of `mlxcel serve`: auth, errors in the OpenAI shape, size caps, admission.

Most checks run against the shared real server process (see test_server_openai); a few
need another configuration and run the same application under uvicorn in-process, and
engine failures are scripted with a stand-in engine behind the real HTTP stack.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.stand_in_engine import StandInEngine
from server_harness import (
    API_KEY,
    AUTH,
    MESSAGES,
    InProcessServer,
    ServeProcess,
    main_server_args,
    shared_server,
)
from sse_reader import sse_json

from mlxcel.config import Settings
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.server.app import create_app
from mlxcel.server.bridge import EngineClient
from mlxcel.server.middleware import ApiKeys
from mlxcel.server.state import ServerState

PATHLIKE = re.compile(r"(/(tmp|home|root|work|usr|var|private|Users)\b)|([A-Za-z]:\\)")


def assert_error(response: httpx.Response, status: int, type: str) -> dict[str, Any]:
    """An OpenAI-shaped error with this status and type, and no file-system path in it."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["type"] == type, error
    assert isinstance(error["message"], str) and error["message"]
    assert not PATHLIKE.search(error["message"]), error["message"]
    return dict(error)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> ServeProcess:
    return shared_server(main_server_args(tiny_llama_dir))


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(headers=AUTH) as client:
        yield client


# ---------------------------------------------------------------------------------- auth


def test_auth_missing_and_invalid_keys(server: ServeProcess) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1}
    with server.client() as anon:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/props")):
            error = assert_error(anon.request(method, path, json=body), 401, "missing_api_key")
            assert "key" in error["message"].lower()
            wrong = anon.request(method, path, json=body, headers={"Authorization": "Bearer no"})
            assert_error(wrong, 401, "invalid_api_key")
        # no query-parameter auth
        assert_error(anon.get(f"/props?api_key={API_KEY}"), 401, "missing_api_key")
        # the public paths stay open (the model list too, as llama-server's)
        assert anon.get("/health").status_code == 200
        assert anon.get("/").status_code == 200
        assert anon.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {API_KEY}"},
        {"Authorization": f"bearer {API_KEY}"},
        {"Authorization": API_KEY},  # the raw key
        {"X-Api-Key": API_KEY},
    ],
)
def test_auth_accepted_spellings(server: ServeProcess, headers: dict[str, str]) -> None:
    with server.client() as client:
        assert client.get("/v1/models", headers=headers).status_code == 200


def test_api_keys_compare_every_key() -> None:
    keys = ApiKeys(["first", "second"])
    assert keys.check("Bearer second", None) is None
    assert keys.check(None, "first") is None
    assert keys.check(None, None) == "missing_api_key"
    assert keys.check("Bearer firs", None) == "invalid_api_key"
    assert keys.check("Bearer ", None) == "invalid_api_key"
    assert ApiKeys([]).check(None, None) is None


def test_cors_preflight_needs_no_key(server: ServeProcess) -> None:
    with server.client() as anon:
        response = anon.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://example.com",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] in ("*", "http://example.com")


# ------------------------------------------------------------------------ routing errors


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert_error(http.get("/nope"), 404, "not_found_error")
    assert_error(http.post("/v1/nothing", json={}), 404, "not_found_error")
    wrong = http.get("/v1/chat/completions")
    assert_error(wrong, 405, "invalid_request_error")
    assert "POST" in wrong.headers.get("allow", "")
    assert_error(http.delete("/v1/models"), 405, "invalid_request_error")


# ------------------------------------------------------------------------ request errors


BAD_JSON_OBJECT = {"type": "json_object", "schema": 1}  # llama-server's schema must be an object
BAD_CHAT_BODIES: list[tuple[str, Any]] = [
    ("not an object", [1, 2]),
    ("missing messages", {"model": "m"}),
    ("messages not a list", {"messages": "nope"}),
    ("empty messages", {"messages": []}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("max_tokens type", {"messages": MESSAGES, "max_tokens": "ten"}),
    ("max_tokens negative", {"messages": MESSAGES, "max_tokens": -5}),
    ("temperature range", {"messages": MESSAGES, "temperature": -1}),
    ("top_p range", {"messages": MESSAGES, "top_p": 1.5}),
    ("n zero", {"messages": MESSAGES, "n": 0}),
    ("n above the choice limit", {"messages": MESSAGES, "n": 17}),
    ("n huge", {"messages": MESSAGES, "n": 10**9}),
    ("top_logprobs bound", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
    ("stop count", {"messages": MESSAGES, "stop": ["x"] * 65}),
    ("stop type", {"messages": MESSAGES, "stop": 5}),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("json_object schema", {"messages": MESSAGES, "response_format": BAD_JSON_OBJECT}),
    ("tool_choice required", {"messages": MESSAGES, "tool_choice": "required"}),
    ("tool_choice unknown fn", {"messages": MESSAGES, "tool_choice": {"type": "function"}}),
    ("stream type", {"messages": MESSAGES, "stream": {"yes": 1}}),
    ("logit_bias key", {"messages": MESSAGES, "logit_bias": {"abc": 1}}),
    ("logit_bias range", {"messages": MESSAGES, "logit_bias": {"99999999": 1}}),
]


@pytest.mark.parametrize("label,body", BAD_CHAT_BODIES, ids=[b[0] for b in BAD_CHAT_BODIES])
def test_bad_chat_bodies_are_400(http: httpx.Client, label: str, body: Any) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, "invalid_request_error")


BAD_COMPLETION_BODIES: list[tuple[str, Any]] = [
    ("missing prompt", {"max_tokens": 1}),
    ("two prompts", {"prompt": ["a", "b"]}),
    ("empty prompt", {"prompt": ""}),
    ("empty token list", {"prompt": []}),
    ("token out of vocab", {"prompt": [10**8]}),
    ("negative token", {"prompt": [-1]}),
    ("prompt type", {"prompt": {"text": "x"}}),
    ("logprobs bound", {"prompt": "x", "logprobs": 50}),
    ("best_of", {"prompt": "x", "best_of": 3}),
]


@pytest.mark.parametrize(
    "label,body", BAD_COMPLETION_BODIES, ids=[b[0] for b in BAD_COMPLETION_BODIES]
)
def test_bad_completion_bodies_are_400(http: httpx.Client, label: str, body: Any) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, "invalid_request_error")


def test_malformed_json_is_400_never_422(http: httpx.Client) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = http.post(
            path, content=b'{"messages": [', headers={"Content-Type": "application/json"}
        )
        assert_error(response, 400, "invalid_request_error")
        assert_error(http.post(path, content=b"\xff\xfe"), 400, "invalid_request_error")


def test_prompt_over_the_context_is_400(http: httpx.Client) -> None:
    long = " ".join(["word"] * 3000)  # the slot context is 1024 tokens
    response = http.post("/v1/completions", json={"prompt": long, "max_tokens": 1})
    error = assert_error(response, 400, "invalid_request_error")
    assert "context" in error["message"]


def test_huge_max_tokens_is_bounded_by_the_context(http: httpx.Client) -> None:
    body = {"prompt": "Hi", "max_tokens": 10**12, "temperature": 0, "stop": []}
    ids = http.post("/tokenize", json={"content": " ".join(["x"] * 1010)}).json()["tokens"]
    tokens = [t if isinstance(t, int) else t["id"] for t in ids][:1016]
    response = http.post("/v1/completions", json={**body, "prompt": tokens, "ignore_eos": True})
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_cache_prompt_field_forms_are_accepted(http: httpx.Client) -> None:
    base = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    answers = [
        http.post("/v1/chat/completions", json={**base, **extra}).json()
        for extra in (
            {"cache_prompt": False},
            {"extra_body": {"cache_prompt": False}},
            {"cache_prompt": True},
            {},
        )
    ]
    texts = {a["choices"][0]["message"]["content"] for a in answers}
    assert len(texts) == 1


# ------------------------------------------------------------------------------ size caps


def test_body_over_the_cap_is_413(http: httpx.Client) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 70_000}]}  # cap: 65536 bytes
    assert_error(http.post("/v1/chat/completions", json=big), 413, "invalid_request_error")

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}]}'

    chunked = http.post("/v1/chat/completions", content=chunks())
    assert_error(chunked, 413, "invalid_request_error")

    def small() -> Iterator[bytes]:
        yield json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()

    assert http.post("/v1/completions", content=small()).status_code == 200


def test_oversized_headers_are_431(server: ServeProcess, http: httpx.Client) -> None:
    response = http.get("/v1/models", headers={"X-Filler": "a" * 40_000})
    assert_error(response, 431, "invalid_request_error")
    # A head that arrives slowly and never ends is cut off by the HTTP parser: 431 too.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: ")
        time.sleep(0.1)
        sock.sendall(b"a" * 100_000)
        reply = b""
        while b"\r\n\r\n" not in reply:
            part = sock.recv(65536)
            if not part:
                break
            reply += part
    assert reply.startswith(b"HTTP/1.1 431")


@pytest.mark.parametrize(
    "head",
    [
        b"X-Filler: " + b"a" * 1_000_000 + b"\r\n",
        b"".join(b"X-H%d: v\r\n" % i for i in range(20_000)),
    ],
    ids=["one-1MB-header", "20000-small-headers"],
)
def test_a_head_past_the_parser_limit_gets_the_431_before_the_close(
    server: ServeProcess, head: bytes
) -> None:
    # The server answers once 32 KB arrived, with the rest of the head still coming: closing
    # the socket with that unread used to reset the connection, losing the answer.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        reply = b""
        while part := sock.recv(65536):
            reply += part
    status, _, body = reply.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 431"), reply[:200]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == "request headers too large: the limit is 32768 bytes"


def test_a_request_framed_by_both_length_and_chunks_is_refused_and_closed(
    server: ServeProcess,
) -> None:
    # A proxy reading Content-Length and this server reading the chunks would disagree on
    # where the body ends: the request smuggled after it must never be answered.
    host, port = server.url.removeprefix("http://").split(":")
    smuggled = b"GET /props HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b'{"content": "hi"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked)
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + chunked + smuggled)
        reply = b""
        while part := sock.recv(65536):
            reply += part
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert reply.count(b"HTTP/1.1 ") == 1  # closed after the 400: the GET got no answer
    _, _, answer = reply.partition(b"\r\n\r\n")
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ----------------------------------------------------------------- in-process variants


@pytest.fixture(scope="module")
def busy_server(tiny_llama_dir: Path) -> Iterator[InProcessServer]:
    settings = Settings(
        model=str(tiny_llama_dir),
        max_queue_depth=0,
        api_prefix="/api/",
        alias="my-alias",
        parallel=1,
        warmup=False,
    )
    with InProcessServer(settings) as server:
        yield server


def test_full_queue_is_503_with_retry_after(busy_server: InProcessServer) -> None:
    with busy_server.client() as client:
        for stream in (False, True):
            body = {"messages": MESSAGES, "max_tokens": 1, "stream": stream}
            response = client.post("/api/v1/chat/completions", json=body)
            assert_error(response, 503, "server_busy")  # JSON, even for a stream request
            assert response.headers["retry-after"].isdigit()
        response = client.post("/api/v1/completions", json={"prompt": "x", "stream": True})
        assert_error(response, 503, "server_busy")


def test_api_prefix_and_alias(busy_server: InProcessServer) -> None:
    with busy_server.client() as client:
        assert client.get("/api/health").status_code == 200
        assert client.get("/api/").status_code == 200
        assert_error(client.get("/health"), 404, "not_found_error")
        models = client.get("/api/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["my-alias"]


# --------------------------------------------------------- scripted engine (no model run)


class ScriptedEngine(StandInEngine):
    """Stands in for TextEngine: answers each request with a fixed list of events."""

    context_per_slot = 256

    def __init__(self, events: list[GenerationEvent]) -> None:
        self.events = events
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        for event in self.events:
            event.request_id = request.request_id
            sink(event)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer: Any) -> Any:
    from mlxcel.engine.tokenizer import Tokenizer

    return Tokenizer(hf_tokenizer)


def scripted_app(tokenizer: Any, events: list[GenerationEvent]) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(events)
    state = ServerState(settings=Settings(warmup=False), tokenizer=tokenizer)
    state.client = EngineClient(engine)
    return create_app(state), engine


def run_requests(app: Any, *requests: tuple[str, dict[str, Any]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(go())


def test_engine_error_is_500_or_finish_reason_error(tokenizer: Any) -> None:
    events = [
        GenerationEvent("x", text="Hel"),
        GenerationEvent("x", finish_reason="error", error="failed reading /tmp/secret/w.bin"),
    ]
    app, _ = scripted_app(tokenizer, events)
    chat = {"messages": MESSAGES, "max_tokens": 4}
    plain, streamed, completion = run_requests(
        app,
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", {"prompt": "x", "stream": True}),
    )
    error = assert_error(plain, 500, "server_error")
    assert "<path>" in error["message"]  # the path is scrubbed
    # Mid-stream: the finish chunk says "error", then the OpenAI error event, then [DONE].
    for text in (streamed.text, completion.text):
        chunks = sse_json(text)
        assert chunks[-2]["choices"][0]["finish_reason"] == "error"
        assert chunks[-1]["error"]["type"] == "server_error"
        assert "<path>" in chunks[-1]["error"]["message"]
        assert text.endswith("data: [DONE]\n\n")


def test_engine_cancellation_never_reaches_a_client(tokenizer: Any) -> None:
    events = [GenerationEvent("x", text="a"), GenerationEvent("x", finish_reason="cancelled")]
    app, _ = scripted_app(tokenizer, events)
    chat = {"messages": MESSAGES}
    plain, streamed = run_requests(
        app, ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True})
    )
    assert_error(plain, 503, "server_busy")
    assert "cancelled" not in streamed.text
    assert '"finish_reason":"error"' in streamed.text


# Text holding the characters str.splitlines breaks at beyond CR/LF (a tiny random model can
# sample them). httpx's iter_lines splits there, so the JSON must escape them.
LINE_BREAKING_TEXT = "a\u2028b\x85c\u2029d\x1ce"


def _stream_texts(body: str) -> list[str]:
    """Every JSON string field named like a text delta in the `data:` lines of `body`, read
    the way httpx's `iter_lines` reads a stream: each line must hold a whole JSON object."""
    texts: list[str] = []

    def collect(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in ("content", "text", "delta") and isinstance(item, str):
                    texts.append(item)
                else:
                    collect(item)
        elif isinstance(value, list):
            for item in value:
                collect(item)

    for chunk in sse_json(body):
        collect(chunk)
    return texts


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/completion", {"prompt": "x"}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/messages", {"messages": MESSAGES[1:], "max_tokens": 4}),
        ("/v1/responses", {"input": "x"}),
    ],
)
def test_streamed_text_with_line_separators_stays_on_one_line(
    tokenizer: Any, path: str, extra: dict[str, Any]
) -> None:
    events = [
        GenerationEvent("x", text=LINE_BREAKING_TEXT[:4]),
        GenerationEvent("x", text=LINE_BREAKING_TEXT[4:]),
        GenerationEvent("x", finish_reason="stop", completion_tokens=2),
    ]
    app, _ = scripted_app(tokenizer, events)
    (streamed,) = run_requests(app, (path, {**extra, "stream": True}))
    assert streamed.status_code == 200, streamed.text
    assert "\\u2028" in streamed.text and "\\u0085" in streamed.text  # escaped
    texts = _stream_texts(streamed.text)
    assert LINE_BREAKING_TEXT[:4] in texts and LINE_BREAKING_TEXT[4:] in texts, texts


def test_loading_state_answers_503(tokenizer: Any) -> None:
    state = ServerState(settings=Settings(warmup=False))
    app = create_app(state)

    async def go() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health"), await client.post(
                "/v1/chat/completions", json={"messages": MESSAGES}
            )

    health, chat = asyncio.run(go())
    assert health.status_code == 503
    assert health.json() == {"status": "loading model", "tool_call_parser": None}
    assert_error(chat, 503, "server_busy")
    assert "retry-after" in chat.headers


def test_no_slot_available_is_503(tokenizer: Any) -> None:
    class Busy(ScriptedEngine):
        slot_state = "decoding"
        queued = ("queued-1",)

    state = ServerState(settings=Settings(warmup=False), tokenizer=tokenizer)
    state.client = EngineClient(Busy([]))
    app = create_app(state)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/health")

    health = asyncio.run(go())
    assert health.status_code == 503
    assert "retry-after" in health.headers
    body = health.json()
    assert body["status"] == "no slot available"
    assert body["batch"] == {"active_sequences": 2, "queue_depth": 1, "max_batch_size": 2}
    assert body["context_size"] == 256


# ------------------------------------------------------------ request fields -> engine


def test_sampling_fields_to_generation_request(tokenizer: Any) -> None:
    from mlxcel.engine.text.request import Priority
    from mlxcel.server.sampling_fields import SamplingFields, to_generation_request

    settings = Settings(temp=0.7, top_k=20, n_predict=64, warmup=False)
    fields = SamplingFields.model_validate(
        {
            "temperature": 0,
            "repeat_penalty": 1.2,  # llama-server spelling
            "stop": "END",
            "seed": 7,
            "extra_body": {"top_k": 5, "temperature": 0.9, "cache_prompt": False},
        }
    )
    assert fields.top_k == 5 and fields.temperature == 0  # the root value wins
    request = to_generation_request(
        fields,
        settings=settings,
        tokenizer=tokenizer,
        family=None,
        prompt_tokens=[1, 2, 3],
        max_tokens=None,
        priority=Priority.HIGH,
    )
    assert request.max_tokens == 64  # --predict is the default limit
    assert request.sampling.temperature == 0 and request.sampling.top_k == 5
    assert request.sampling.repetition_penalty == 1.2 and request.sampling.seed == 7
    assert request.stop == ("END",)
    assert request.cache_prompt is False
    assert request.priority is Priority.HIGH


def test_cache_prompt_cannot_be_turned_back_on() -> None:
    from mlxcel.server.sampling_fields import resolve_cache_prompt

    off = Settings(cache_prompt=False, warmup=False)
    on = Settings(warmup=False)
    assert resolve_cache_prompt(off, True) is False
    assert resolve_cache_prompt(off, None) is False
    assert resolve_cache_prompt(on, None) is True
    assert resolve_cache_prompt(on, False) is False


def test_template_kwargs_precedence() -> None:
    from mlxcel.server.chat.prompt import template_kwargs
    from mlxcel.server.openai_chat.protocol import ChatCompletionRequest

    state = ServerState(
        settings=Settings(chat_template_kwargs={"a": 1, "preserve_thinking": False}, warmup=False)
    )

    def kwargs(extra: dict[str, Any]) -> dict[str, Any]:
        body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **extra})
        return template_kwargs(state, body.chat_request(), -1)

    assert kwargs({}) == {"a": 1, "preserve_thinking": False}
    assert kwargs({"chat_template_kwargs": {"a": 2}}) == {"a": 2, "preserve_thinking": False}
    nested = {"extra_body": {"chat_template_kwargs": {"b": 3}, "preserve_thinking": True}}
    assert kwargs(nested) == {"a": 1, "b": 3, "preserve_thinking": False}
    flat = {"extra_body": {"preserve_thinking": True}}
    assert kwargs(flat)["preserve_thinking"] is True
    both = {"chat_template_kwargs": {"x": 0}, "extra_body": {"chat_template_kwargs": {"y": 1}}}
    assert kwargs(both) == {"a": 1, "preserve_thinking": False, "x": 0}


def test_tool_choice_rendering(tokenizer: Any) -> None:
    from mlxcel.server.chat.prompt import add_directive, select_tools
    from mlxcel.server.openai_chat.protocol import ChatCompletionRequest

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {}}},
        {"type": "function", "function": {"name": "g", "parameters": {}}},
    ]

    def select(choice: Any) -> tuple[Any, Any]:
        body = {"messages": MESSAGES, "tools": tools, "tool_choice": choice}
        return select_tools(ChatCompletionRequest.model_validate(body).chat_request())

    assert select(None) == (tools, None)
    assert select("auto") == (tools, None)
    assert select("none") == (None, None)
    chosen, directive = select({"type": "function", "function": {"name": "g"}})
    assert chosen == [tools[1]] and directive is not None and "`g`" in directive
    assert select("required")[0] == tools
    messages = [{"role": "user", "content": "hi"}]
    add_directive(messages, "CALL")
    assert messages == [{"role": "user", "content": "hi\n\nCALL"}]
    with_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    add_directive(with_system, "CALL")
    assert with_system[0]["content"] == "S\n\nCALL" and with_system[1]["content"] == "hi"


def test_sse_keepalive_pings_while_waiting() -> None:
    from mlxcel.server.sse import with_keepalive

    async def slow() -> Any:
        yield 1
        await asyncio.sleep(0.35)
        yield 2

    async def collect() -> list[Any]:
        return [item async for item in with_keepalive(slow(), 0.1)]

    items = asyncio.run(collect())
    assert items[0] == 1 and items[-1] == 2
    assert 2 <= items.count(None) <= 4
