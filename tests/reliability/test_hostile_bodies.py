"""Hostile input on every generation route of a real server: a clear 4xx, the server still
up, no traceback in its log (deep nesting, huge arrays, wrong types at every field, invalid
UTF-8, NUL bytes, oversize headers and bodies, slowloris bodies, a 25 MiB+ audio upload, a
64 KiB+ schema, ReDoS-shaped patterns and stop strings)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from server_harness import ServeProcess

MAX_BODY = 1 << 20

ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/completion": {"prompt": "hi", "n_predict": 4},
    "/infill": {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/conversations": {"items": [{"role": "user", "content": "hi"}], "metadata": {"k": "v"}},
}
ARRAY_FIELD = {
    "/v1/chat/completions": "messages",
    "/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/completion": "prompt",
    "/infill": "input_extra",
    "/v1/responses": "input",
    "/v1/messages": "messages",
    "/v1/conversations": "items",
}
WRONG = [12345, -1, 1e308, "text", "", [], [1, "a", None], {}, {"x": {"y": []}}, None, True]
WRONG_FAST = [12345, "text", [1, "a", None], {"x": {"y": []}}, None]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "1024", "--no-warmup"]
    args += ["--max-body-size", str(MAX_BODY), "--timeout", "2"]
    with ServeProcess(args) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(timeout=60) as http:
        yield http


def answered(path: str, response: httpx.Response) -> bool:
    """Refused with a 4xx or answered; /infill's 501 (the tiny model has no FIM tokens) too."""
    return response.status_code < 500 or (path == "/infill" and response.status_code == 501)


def assert_clear_4xx(response: httpx.Response, *statuses: int) -> None:
    allowed = statuses or tuple(range(400, 500))
    if response.request.url.path == "/infill" and not statuses:
        allowed = (*allowed, 501)
    assert response.status_code in allowed, (response.status_code, response.text[:300])
    body = response.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]


def assert_still_up(server: ServeProcess) -> None:
    assert server.proc is not None and server.proc.poll() is None, server.stderr
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "Traceback" not in server.stderr, server.stderr[-3000:]
    assert "Exception in ASGI application" not in server.stderr, server.stderr[-3000:]


def post_raw(client: httpx.Client, path: str, payload: bytes) -> httpx.Response:
    return client.post(path, content=payload, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", list(ROUTES))
def test_deep_nesting(client: httpx.Client, server: ServeProcess, path: str) -> None:
    depth = 200_000
    field = ARRAY_FIELD[path]
    payload = b'{"' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    assert_clear_4xx(post_raw(client, path, payload), 400)
    nested: Any = "x"
    for _ in range(900):  # deep but parseable JSON: refused or answered, never a 5xx
        nested = {"a": nested}
    body = {**ROUTES[path], "metadata": nested}
    assert answered(path, client.post(path, json=body))
    assert_still_up(server)


@pytest.mark.parametrize("path", list(ROUTES))
def test_huge_arrays(client: httpx.Client, server: ServeProcess, path: str) -> None:
    field = ARRAY_FIELD[path]
    item: Any = {"role": "user", "content": "a"} if "messages" in field else "a"
    body = {**ROUTES[path], field: [item] * 60_000}
    response = client.post(path, json=body)
    assert_clear_4xx(response)
    stops = {**ROUTES[path], "stop": ["a"] * 60_000}
    assert answered(path, client.post(path, json=stops))
    assert_still_up(server)


@pytest.mark.parametrize(
    ("path", "values"),
    [pytest.param(path, WRONG_FAST, id=path) for path in ROUTES]
    + [pytest.param(path, WRONG, id=f"all-{path}", marks=pytest.mark.soak) for path in ROUTES],
)
def test_wrong_types_at_every_field(
    client: httpx.Client, server: ServeProcess, path: str, values: list[Any]
) -> None:
    base = ROUTES[path]
    fields = [*base, "temperature", "stream", "stop", "seed", "tools", "response_format"]
    for field in fields:
        for value in values:
            response = client.post(path, json={**base, field: value})
            assert answered(path, response), (field, value, response.text[:300])
            if response.status_code >= 400:
                assert_clear_4xx(response)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                response.read()
    for value in [v for v in WRONG if not isinstance(v, dict)]:  # the body not an object
        assert_clear_4xx(post_raw(client, path, json.dumps(value).encode()))
    assert_still_up(server)


@pytest.mark.parametrize("path", list(ROUTES))
def test_invalid_utf8_and_nul_bytes(client: httpx.Client, server: ServeProcess, path: str) -> None:
    field = "prompt" if "prompt" in ROUTES[path] else ARRAY_FIELD[path]
    assert_clear_4xx(post_raw(client, path, b'{"' + field.encode() + b'": "\xff\xfe\xc3"}'), 400)
    assert_clear_4xx(post_raw(client, path, b"\x00" * 64), 400)
    nul = json.loads(json.dumps(ROUTES[path]).replace('"hi"', '"h\\u0000i"'))
    assert answered(path, client.post(path, json=nul))
    assert_still_up(server)


def test_oversize_headers_and_bodies(client: httpx.Client, server: ServeProcess) -> None:
    for path, body in ROUTES.items():
        response = client.post(path, json=body, headers={"x-padding": "a" * 40_000})
        assert response.status_code == 431, (path, response.status_code)
        big = json.dumps({**body, "padding": "a" * (MAX_BODY + 1)}).encode()
        assert_clear_4xx(post_raw(client, path, big), 413)
    assert_still_up(server)


def _slow_body(url: str, path: str) -> bytes:
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": ')
        time.sleep(3)  # past --timeout 2 without another byte
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_slowloris_bodies_get_408(server: ServeProcess) -> None:
    for path in ("/v1/chat/completions", "/completion"):
        answer = _slow_body(server.url, path)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert_still_up(server)


def test_a_25_mib_audio_upload_is_refused(client: httpx.Client, server: ServeProcess) -> None:
    blob = b"\x00" * (26 << 20)
    response = client.post(
        "/v1/audio/transcriptions",
        files={"file": ("big.wav", blob, "audio/wav")},
        data={"model": "whisper"},
    )
    assert response.status_code in (413, 501), response.status_code
    assert response.json()["error"]["message"]
    assert_still_up(server)


def test_a_64_kib_schema_and_redos_patterns(client: httpx.Client, server: ServeProcess) -> None:
    properties = {f"field_{i:05d}": {"type": "string", "maxLength": 4} for i in range(2_000)}
    big_schema = {"type": "object", "properties": properties, "required": list(properties)}
    assert len(json.dumps(big_schema)) > 64 * 1024
    redos = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    for schema in (big_schema, redos):
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema},
            },
        }
        response = client.post("/v1/chat/completions", json=body, timeout=60)  # never hangs
        assert response.status_code < 500, response.text[:300]
        if response.status_code >= 400:
            assert_clear_4xx(response)
    stops = ["(a+)+$", "a" * 5000, "\x00", "\ud7ff" * 10] + [f"s{i}" for i in range(500)]
    body = {"prompt": "aaaaaaaaaaaaaaaaaaaa", "n_predict": 16, "stop": stops}
    assert client.post("/completion", json=body).status_code < 500
    assert_still_up(server)
