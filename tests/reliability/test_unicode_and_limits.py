"""Bodies that are valid JSON but not acceptable, through a real server: lone UTF-16
surrogates (`"\\ud800"`) in a text field of every JSON route, nesting past the limit on
/props and the routes, token ids outside the vocabulary; then the open-file limit a server
starts under (`ulimit -n 1024`). Each answer is a 400 in the route family's error shape on
a connection that stays usable, with nothing in the server's log."""

from __future__ import annotations

import http.client
import json
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from server_harness import ServeProcess
from test_hostile_bodies import ROUTES, assert_still_up

from mlxcel.server.json_body import MAX_JSON_DEPTH

LONE = "\ud800"
MESSAGES = [{"role": "user", "content": "hi"}]
ANTHROPIC_ROUTES = {"/v1/messages", "/v1/messages/count_tokens"}
JSON_ROUTES: dict[str, dict[str, Any]] = {
    **ROUTES,
    "/v1/chat/completions/input_tokens": {"messages": MESSAGES},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/v1/responses/compact": {"input": "hi"},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": MESSAGES},
    "/tokenize": {"content": "hi"},
    "/apply-template": {"messages": MESSAGES},
    "/v1/embeddings": {"input": "hi"},
    "/embedding": {"content": "hi"},
    "/embeddings": {"content": "hi"},
    "/v1/rerank": {"query": "hi", "documents": ["hi", "there"]},
    "/rerank": {"query": "hi", "texts": ["hi", "there"]},
}

OTHER_ANSWER = {"/infill": 501, "/v1/responses/compact": 400}
"""The tiny model has no fill-in-the-middle tokens; a one-message history, nothing to
compact: answers a good request may get besides 200."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    from mlxcel.engine.embeddings.loader import default_embedding_model_dir

    minilm = str(default_embedding_model_dir())
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "1024", "--no-warmup", "--props"]
    args += ["--embedding-model", minilm, "--reranker-model", minilm]
    with ServeProcess(args) as running:
        yield running


def with_text(body: Any, text: str) -> Any:
    """`body` with every "hi" (and the /infill prefix) replaced by `text`."""
    if isinstance(body, dict):
        return {key: with_text(value, text) for key, value in body.items()}
    if isinstance(body, list):
        return [with_text(item, text) for item in body]
    return text if body in ("hi", "def f(") else body


def exchange(
    conn: http.client.HTTPConnection, path: str, payload: bytes
) -> tuple[int, dict[str, str], bytes]:
    conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert not response.will_close, (path, response.status, response.getheaders())
    return response.status, {k.lower(): v for k, v in response.getheaders()}, data


def error_message(path: str, status: int, data: bytes) -> str:
    """The error's message, after checking the route family's 400 shape."""
    assert status == 400, (path, status, data[:300])
    body = json.loads(data)
    if path in ANTHROPIC_ROUTES:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error", body
    message = body["error"]["message"]
    assert isinstance(message, str) and "Traceback" not in message
    return message


@pytest.mark.parametrize("path", list(JSON_ROUTES))
def test_lone_surrogates_are_a_400_on_a_connection_that_stays_open(
    server: ServeProcess, path: str
) -> None:
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        base = JSON_ROUTES[path]
        for text in (LONE, "a\udfffb", f"ok {LONE}"):
            bad = json.dumps(with_text(base, text)).encode()  # ASCII: `\ud800` escapes
            assert b"\\ud" in bad
            sock = conn.sock
            status, _, data = exchange(conn, path, bad)
            message = error_message(path, status, data)
            assert "lone surrogate" in message and "\\u" in message, message
            assert sock is None or conn.sock is sock  # the same connection
        key = json.dumps({**base, f"x{LONE}": 1}).encode()  # in an object key
        assert "lone surrogate" in error_message(path, *exchange(conn, path, key)[::2])
        sock = conn.sock
        # then a good request on the same connection, a pair of surrogates in it (U+1F600)
        good = json.dumps(with_text(base, "hi \ud83d\ude00")).encode()
        assert b"\\ud83d\\ude00" in good
        status, headers, data = exchange(conn, path, good)
        assert conn.sock is sock
        assert status in (200, OTHER_ANSWER.get(path)), (status, data[:300])
        assert b"surrogate" not in data
        if headers.get("content-type", "").startswith("text/event-stream"):
            assert data
    finally:
        conn.close()
    assert_still_up(server)


def test_the_error_names_where_the_surrogate_is(server: ServeProcess) -> None:
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        body = {"messages": [MESSAGES[0], {"role": "user", "content": [{"type": "text"}]}]}
        body["messages"][1]["content"][0]["text"] = f"x{LONE}"
        path = "/v1/chat/completions"
        message = error_message(path, *exchange(conn, path, json.dumps(body).encode())[::2])
        assert "messages[1].content[0].text" in message and "\\ud800" in message, message
    finally:
        conn.close()


def nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("path", ["/props", "/v1/chat/completions", "/v1/embeddings", "/rerank"])
def test_nesting_past_the_limit_is_a_400(server: ServeProcess, path: str) -> None:
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        for depth in (MAX_JSON_DEPTH, 900, 200_000):  # one past the limit (object + arrays)
            message = error_message(path, *exchange(conn, path, nested(depth))[::2])
            assert f"at most {MAX_JSON_DEPTH} levels" in message, message
        if path == "/props":  # at the limit: accepted
            status, _, data = exchange(conn, path, nested(MAX_JSON_DEPTH - 1))
            assert status == 200 and json.loads(data) == {"success": True}
    finally:
        conn.close()
    assert_still_up(server)


def test_token_ids_out_of_vocabulary_are_a_400(server: ServeProcess, hf_tokenizer: Any) -> None:
    vocab = len(hf_tokenizer)
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        status, _, data = exchange(conn, "/tokenize", b'{"content": "hi"}')
        ok = json.loads(data)["tokens"]
        for bad in (-1, vocab, 2**63 + 5):
            payload = json.dumps({"tokens": [*ok, bad, -5]}).encode()
            message = error_message("/detokenize", *exchange(conn, "/detokenize", payload)[::2])
            assert message == f"token id {bad} is out of vocabulary range (vocab_size {vocab})"
            for path, field in (("/completion", "prompt"), ("/v1/completions", "prompt")):
                payload = json.dumps({field: [*ok, bad, -5], "max_tokens": 2}).encode()
                message = error_message(path, *exchange(conn, path, payload)[::2])
                assert f"token id {bad}, out of vocabulary range (vocab_size {vocab})" in message
        status, _, data = exchange(conn, "/detokenize", json.dumps({"tokens": ok}).encode())
        assert status == 200 and json.loads(data)["content"]
    finally:
        conn.close()
    assert_still_up(server)


def test_tokenize_decode_cli_out_of_vocabulary(tiny_llama_dir: Path) -> None:
    for bad in ("-1", "1,99999999"):
        run = subprocess.run(
            [sys.executable, "-m", "mlxcel", "tokenize", "-m", str(tiny_llama_dir)]
            + ["--decode", bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode != 0
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "out of the vocabulary (size " in lines[0], run.stderr
        assert bad.split(",")[-1] in lines[0]


# ------------------------------------------------------------------ the open-file limit


def open_file_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-file limit in /proc")


@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads /proc/PID/limits")
def test_serve_keeps_the_file_limit_and_the_converted_model(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """mlx-lm's import set the file limit to (2048, 4096): under `ulimit -n 1024` (soft and
    hard) that failed and serve deleted the converted model from the store and exited, and
    a higher limit was cut to 2048. Now a server converts under the usual limit, the next
    one starts from the store under (1024, 1024), each keeps its limit, the entry stays."""
    store = tmp_path / "store"
    env = {"MLXCEL_MODEL_STORE": str(store)}
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    usual = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    for limit in (usual, 1024):  # converting, then from the store
        limits = {resource.RLIMIT_NOFILE: (limit, limit)}
        with ServeProcess(["-m", str(tiny_gguf), "--no-warmup"], env=env, rlimits=limits) as s:
            assert s.proc is not None
            assert open_file_limit(s.proc.pid) == (limit, limit)
            with s.client() as http:
                body = {"prompt": "hi", "n_predict": 2}
                assert http.post("/completion", json=body).status_code == 200
            assert "converting again" not in s.stderr and "Traceback" not in s.stderr
        assert len(list(store.rglob("mlxcel.json"))) == 1


def test_a_store_entry_is_only_removed_when_it_is_damaged(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from mlxcel.engine.loading import gguf
    from mlxcel.engine.loading.store import ModelStore

    store = ModelStore(tmp_path / "store")
    gguf.load_gguf(tiny_gguf, store=store)  # converted and saved
    entries = list(store.root.rglob("mlxcel.json"))
    assert len(entries) == 1

    def out_of_files(directory: Path) -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(gguf, "load_converted", out_of_files)
    with pytest.raises(OSError, match="Too many open files"):
        gguf.load_gguf(tiny_gguf, store=store)
    assert list(store.root.rglob("mlxcel.json")) == entries  # kept: the entry is fine

    def cannot_open(directory: Path) -> Any:  # mx.load's error when out of descriptors
        raise RuntimeError("[load_safetensors] Failed to open file")

    def no_descriptors(path: Path, mode: str = "r") -> Any:  # for the store's files
        if Path(path).is_relative_to(store.root):
            raise OSError(errno.EMFILE, "Too many open files")
        return open(path, mode)

    monkeypatch.setattr(gguf, "load_converted", cannot_open)
    monkeypatch.setattr(gguf, "open", no_descriptors, raising=False)
    with pytest.raises(RuntimeError, match="Failed to open"):
        gguf.load_gguf(tiny_gguf, store=store)
    monkeypatch.delattr(gguf, "open")
    assert list(store.root.rglob("mlxcel.json")) == entries  # kept again

    def truncated(directory: Path) -> Any:
        raise ValueError("incomplete safetensors header")

    monkeypatch.setattr(gguf, "load_converted", truncated)
    assert gguf.load_gguf(tiny_gguf, store=store).store_path is not None  # converted again
    assert len(list(store.root.rglob("mlxcel.json"))) == 1


def test_json_inside_a_compaction_capsule_gets_the_same_checks(server: ServeProcess) -> None:
    """A compaction item's `encrypted_content` is client-supplied base64 JSON: too deep or
    holding a lone surrogate, it is a 400 naming the item (it was a 500 RecursionError)."""
    import base64

    inner = [b"[" * 200_000 + b"]" * 200_000, b'{"format": "x", "s": "\\ud800"}', b"{"]
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        for capsule in inner:
            encoded = base64.urlsafe_b64encode(capsule).decode()
            item = {"type": "compaction", "encrypted_content": encoded}
            body = {"input": [item, {"role": "user", "content": "hi"}], "max_output_tokens": 2}
            path = "/v1/responses"
            message = error_message(path, *exchange(conn, path, json.dumps(body).encode())[::2])
            assert message.startswith("invalid compaction item: encrypted_content"), message
    finally:
        conn.close()
    assert_still_up(server)


def test_every_typed_json_body_is_read_by_read_json_body() -> None:
    """Routes read JSON through `read_json_body`; one whose body FastAPI parses into a
    typed parameter must be a JsonBodyRoute, or the checks above would not hold for it."""
    from fastapi.routing import APIRoute

    from mlxcel.config import Settings
    from mlxcel.server.app import create_app
    from mlxcel.server.json_body import JsonBodyRoute
    from mlxcel.server.state import ServerState

    def routes_of(routes: list[Any]) -> Iterator[Any]:
        for route in routes:  # included routers hold their routes (FastAPI >= 0.16x)
            inner = getattr(route, "original_router", None)
            yield from routes_of(inner.routes) if inner is not None else (route,)

    app = create_app(ServerState(settings=Settings(warmup=False)))
    typed = [
        r for r in routes_of(app.routes) if isinstance(r, APIRoute) and r.body_field is not None
    ]
    assert {"/v1/embeddings", "/v1/rerank", "/v1/audio/speech"} <= {r.path for r in typed}
    assert [r.path for r in typed if not isinstance(r, JsonBodyRoute)] == []


def test_json_inside_tool_call_arguments_gets_the_same_checks(server: ServeProcess) -> None:
    """An assistant message's `tool_calls[].function.arguments` is JSON text the server
    parses for the template: too deep, or with a lone surrogate escape, it is kept as the
    string it is (as arguments that are not JSON are), never a 500."""
    parts = urlsplit(server.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    try:
        for arguments in ("[" * 200_000 + "]" * 200_000, '{"city": "\\ud800"}', "{"):
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": arguments},
            }
            body = {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ],
                "max_tokens": 2,
            }
            for path in ("/v1/chat/completions", "/apply-template"):
                status, _, data = exchange(conn, path, json.dumps(body).encode())
                assert status == 200, (path, arguments[:20], data[:300])
    finally:
        conn.close()
    assert_still_up(server)
