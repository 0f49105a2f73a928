"""Idle, slow and flooding connections against a real server: sockets that never send a
byte and slowloris sockets that trickle a header line are closed within the head bound;
past `--max-connections` a request gets a JSON 503 while `/health` still answers; a flood
of unauthenticated idle connections (`--api-key` set) never runs the server out of file
descriptors; a client that closes at once leaves no traceback; a 100 KB query string is a
JSON 414. The figures in docs/reliability.md come from the printed measurements."""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import ServeProcess

KEY = "sk-slow-test"
HEAD_SECONDS = 2  # --timeout 2: the request-head bound (and the idle one) of `server`
GIVE_UP_S = 60.0  # far past the bound: a socket still open then was never dropped
FILE_LIMIT = 1024  # the server's soft open-file limit at start (mlx-lm raises it to 2048)
FLOOD = 2300  # more connections than the raised limit holds


@contextlib.contextmanager
def _soft_file_limit(limit: int) -> Iterator[None]:
    """Lower this process's soft open-file limit (a child started inside inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "1024", "--no-warmup"]
    args += ["--timeout", str(HEAD_SECONDS), "--api-key", KEY]
    running = ServeProcess(args)
    with _soft_file_limit(FILE_LIMIT):
        running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def capped(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "1024", "--no-warmup"]
    args += ["--max-connections", "20", "--api-key", KEY]
    with ServeProcess(args) as running:
        yield running


def _address(server: ServeProcess) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _connect(server: ServeProcess, count: int, first: bytes = b"") -> dict[socket.socket, float]:
    """`count` connections (each sent `first`), with the time each was opened."""
    socks = {}
    for _ in range(count):
        sock = socket.create_connection(_address(server), timeout=30)
        if first:
            sock.sendall(first)
        socks[sock] = time.monotonic()
    return socks


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except ConnectionError:
        return True


def _wait_all_closed(socks: dict[socket.socket, float], trickle: bytes = b"") -> list[float]:
    """How long each socket lived until the server closed it (`trickle` is sent every
    second to the ones still open); stops at GIVE_UP_S, leaving the survivors out."""
    start = last = time.monotonic()
    open_socks = dict(socks)
    lived: list[float] = []
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while open_socks and time.monotonic() - start < GIVE_UP_S:
            if trickle and time.monotonic() - last >= 1.0:
                last = time.monotonic()
                for sock in list(open_socks):
                    with contextlib.suppress(OSError):
                        sock.sendall(trickle)
            for key, _ in selector.select(0.2):
                sock = key.fileobj  # type: ignore[assignment]
                if sock in open_socks and _closed_by_server(sock):
                    selector.unregister(sock)
                    lived.append(time.monotonic() - open_socks.pop(sock))
    for sock in socks:
        sock.close()
    return lived


def _health_ms(server: ServeProcess) -> float:
    start = time.monotonic()
    response = httpx.get(f"{server.url}/health", timeout=30)
    assert response.status_code == 200, response.text[:200]
    return (time.monotonic() - start) * 1000


def assert_no_traceback(server: ServeProcess) -> None:
    log = server.stderr
    assert "Traceback" not in log, log[-3000:]
    assert "ClientDisconnect" not in log, log[-3000:]
    assert "out of system resource" not in log, log[-3000:]


def test_idle_connections_are_closed(server: ServeProcess) -> None:
    socks = _connect(server, 100)
    lived = _wait_all_closed(socks)
    assert len(lived) == len(socks)
    print(f"\n100 idle sockets closed after {min(lived):.1f}-{max(lived):.1f} s")
    assert_no_traceback(server)


def test_slowloris_heads_are_closed(server: ServeProcess) -> None:
    socks = _connect(server, 100, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    lived = _wait_all_closed(socks, trickle=b"X-Slow: 1\r\n")
    assert len(lived) == len(socks)
    print(f"\n100 slowloris sockets closed after {min(lived):.1f}-{max(lived):.1f} s")
    _health_ms(server)
    assert_no_traceback(server)


def test_a_client_closing_at_once_leaves_no_traceback(server: ServeProcess) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    ).encode()
    requests = [
        head + b"Content-Length: %d\r\n\r\n" % len(body) + body,  # whole, then closed
        head + b"Content-Length: 100\r\n\r\n" + body[:20],  # part of the body
        head + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n",  # a bad chunk size
    ]
    for request in requests * 3:
        with socket.create_connection(_address(server), timeout=10) as sock:
            sock.sendall(request)
    time.sleep(1.0)  # the server handles the disconnects (nothing to poll for)
    _health_ms(server)
    assert_no_traceback(server)


def _raw_get(server: ServeProcess, target: str) -> tuple[int, bytes]:
    """GET `target` over a plain socket (httpx refuses URLs over 64 KiB): status, body."""
    request = f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    with socket.create_connection(_address(server), timeout=30) as sock:
        sock.sendall(request.encode() + b"Connection: close\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/chat/completions"])
def test_a_100_kb_query_string_is_414(server: ServeProcess, path: str) -> None:
    status, body = _raw_get(server, f"{path}?q={'a' * 100_000}")
    assert status == 414, body[:200]
    error = json.loads(body)["error"]
    assert "too long" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_connection_flood_keeps_health_answering(server: ServeProcess) -> None:
    socks: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            with contextlib.suppress(OSError):  # the server closes the oldest overflow
                socks.append(socket.create_connection(_address(server), timeout=30))
        latency = _health_ms(server)
        print(f"\n/health with {FLOOD} connections opened: {latency:.0f} ms")
        assert server.proc is not None and server.proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
    _health_ms(server)
    assert_no_traceback(server)


def test_past_the_cap_503_and_health_still_answers(capped: ServeProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    held = _connect(capped, 20, b"GET /v1/models HTTP/1.1\r\n")  # the cap: 20
    try:
        response = httpx.get(f"{capped.url}/v1/models", headers=auth, timeout=30)
        assert response.status_code == 503, response.text[:200]
        assert response.json()["error"]["type"] == "server_busy"
        assert response.headers["connection"] == "close"
        assert response.headers["retry-after"]
        extra = _connect(capped, 60)  # past the overflow room too: the oldest are dropped
        try:
            latency = _health_ms(capped)
            print(f"\n/health past the cap (20 held, 60 more open): {latency:.0f} ms")
        finally:
            for sock in extra:
                sock.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + GIVE_UP_S  # the server sees the closes, then has room
    status = 0
    while status != 200 and time.monotonic() < deadline:
        status = httpx.get(f"{capped.url}/v1/models", headers=auth, timeout=30).status_code
    assert status == 200
    assert_no_traceback(capped)
