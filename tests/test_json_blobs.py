"""Long strings are lifted out of a JSON body before parsing (mlxcel.server.json_blobs).

The value must be `json.loads`'s for every body, and every body it refuses must still be
refused; the parser must never see the megabytes of a data URI (the structural check that
the event loop's stall does not grow with a picture's size).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import sys
import threading
from typing import Any

import pytest

from mlxcel.server import json_blobs, json_body
from mlxcel.server.errors import APIError
from mlxcel.server.json_blobs import BLOB_MIN, lift_blobs, restore_blobs
from mlxcel.server.json_body import OFF_LOOP_BYTES, decode_json_body
from mlxcel.server.media import offload


def _b64(n: int, seed: int = 0) -> str:
    return base64.b64encode(random.Random(seed).randbytes(n)).decode()


def _chat(uri: str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": uri}},
    ]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_the_parser_never_sees_a_data_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    uri = "data:image/png;base64," + _b64(3 << 20)
    raw = json.dumps(_chat(uri)).encode()
    seen: list[int] = []
    loads = json.loads

    def recorded(text: Any) -> Any:
        seen.append(len(text))
        return loads(text)

    monkeypatch.setattr(json_body.json, "loads", recorded)
    assert decode_json_body(raw) == _chat(uri)
    assert seen and max(seen) < 1024, seen


def test_a_large_body_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from starlette.requests import Request

    threads: list[str] = []
    decode = json_body.decode_json_body

    def recorded(raw: bytes, what: str = "request body") -> Any:
        threads.append(threading.current_thread().name)
        return decode(raw, what)

    monkeypatch.setattr(json_body, "decode_json_body", recorded)

    async def read(raw: bytes) -> Any:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": raw, "more_body": False}

        return await json_body.read_json_body(Request({"type": "http"}, receive))

    big = _chat("data:image/png;base64," + _b64(OFF_LOOP_BYTES))
    assert asyncio.run(read(json.dumps(big).encode())) == big
    assert asyncio.run(read(b'{"small": 1}')) == {"small": 1}
    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    assert threads[0].startswith(offload.THREAD_PREFIX), threads
    assert threads[1] == loop_thread
    # The pool shortened the switch interval: the loop waits at most that for the GIL.
    assert sys.getswitchinterval() <= offload.SWITCH_INTERVAL


@pytest.mark.parametrize(
    "value",
    [
        {"a": "x" * BLOB_MIN, "b": ["y" * (BLOB_MIN + 7), 1, None, {"c": "z" * BLOB_MIN}]},
        ["x" * BLOB_MIN] * 3,  # the same blob three times
        "x" * (BLOB_MIN + 1),  # a top-level string
        {"k" * BLOB_MIN: 1, "k" * BLOB_MIN + "2": {"k" * BLOB_MIN: 2}},  # object keys
        {"quoted": 'say "' + "q" * BLOB_MIN + '"', "escaped": "\\" * 3 + "w" * BLOB_MIN},
        {"unicode": "é" * BLOB_MIN, "tab": "\t" + "t" * BLOB_MIN, "nul": "\x00" * BLOB_MIN},
        {"short": "s" * (BLOB_MIN - 1), "text": 'data:"' + "d" * BLOB_MIN},
        {"placeholder-like": "mlxcel-blob-0-0", "b": "b" * BLOB_MIN},
    ],
)
def test_values_equal_the_parsers(value: Any) -> None:
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        assert decode_json_body(raw) == json.loads(raw)


def test_lifted_strings_are_the_long_plain_ones() -> None:
    plain, escaped = "p" * BLOB_MIN, "e\\" + "e" * BLOB_MIN
    raw = json.dumps({"plain": plain, "escaped": escaped, "short": "s" * 10}).encode()
    skeleton, blobs = lift_blobs(raw)
    assert list(blobs.values()) == [plain]
    assert len(skeleton) < len(raw) - BLOB_MIN + 64  # the placeholder
    assert restore_blobs(json.loads(skeleton), blobs) == json.loads(raw)


def test_random_bodies_equal_the_parsers() -> None:
    """Bodies built of long strings, escapes and quotes in random places."""
    rng = random.Random(1)
    atoms = ["x" * BLOB_MIN, '"', "\\", "\\\\", 'a"b', "\n", "é", "data:", "", "zz"]
    for _ in range(200):
        strings = ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 4))) for _ in range(4)]
        value = {strings[0]: [strings[1], {"k": strings[2]}], "v": strings[3]}
        raw = json.dumps(value).encode()
        assert decode_json_body(raw) == value


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + b"x" * BLOB_MIN + b'"',  # unterminated object
        b'{"a": "' + b"x" * BLOB_MIN,  # unterminated string
        b'{"a": "x"' + b"x" * BLOB_MIN + b'"}',  # a quote closes, bare text follows
        b'["' + b"x" * BLOB_MIN + b'" "' + b"y" * BLOB_MIN + b'"]',  # no comma
        b'{"a": "' + b"x" * BLOB_MIN + b"\x01" + b'"}',  # a raw control character
        b'{"a": "' + b"x" * BLOB_MIN + b"\xff" + b'"}',  # not UTF-8
        b'{"a": "\\' + b"x" * BLOB_MIN + b'"}',  # a bad escape
    ],
)
def test_refused_bodies_stay_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(APIError, match="not valid JSON"):
        decode_json_body(raw)


def test_a_lone_surrogate_beside_a_blob_is_still_refused() -> None:
    raw = b'{"a": "' + b"x" * BLOB_MIN + b'", "b": "\\ud800"}'
    with pytest.raises(APIError, match="lone surrogate"):
        decode_json_body(raw)


def test_a_utf16_body_is_parsed_as_it_is() -> None:
    value = {"a": "x" * BLOB_MIN}
    raw = json.dumps(value).encode("utf-16")
    assert lift_blobs(raw) == (raw, {})
    assert decode_json_body(raw) == value


def test_the_walk_stops_after_its_quote_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_blobs, "MAX_QUOTES", 4)
    value = {"a": "x" * BLOB_MIN, "b": "y" * BLOB_MIN}  # 8 quotes: the second is kept
    skeleton, blobs = lift_blobs(json.dumps(value).encode())
    assert list(blobs.values()) == ["x" * BLOB_MIN]
    assert restore_blobs(json.loads(skeleton), blobs) == value
