"""Contract gaps found by running llama.cpp's server test suite against `mlxcel serve` next to a
real llama-server on the same models (docs/llama-compat.md), each through a real server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import API_KEY, AUTH, ServeProcess
from sse_reader import sse_json


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[str]:
    args = ["-m", str(tiny_llama_dir), "-c", "1024", "-np", "1", "--api-key", API_KEY]
    with ServeProcess(args).start() as proc:
        yield proc.url


def _messages(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/messages", json=body, headers=AUTH, timeout=120)


def test_anthropic_usage_reports_cache_reads(server: str) -> None:
    """`usage.cache_read_input_tokens` is always there and counts the cached prefix;
    `input_tokens` is the rest of the prompt (Anthropic's and llama-server's split: with
    `cache_creation_input_tokens` 0 they add up to what count_tokens answers)."""
    text = "Tell me a long story about a cat and a dog in a garden " * 4
    # Greedy: with default sampling the random model draws its end token first now and then.
    body = {
        "model": "m",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
    }
    counted = httpx.post(
        f"{server}/v1/messages/count_tokens", json=body, headers=AUTH, timeout=120
    ).json()["input_tokens"]

    def prompt(usage: dict[str, int]) -> int:
        return (
            usage["input_tokens"]
            + usage["cache_read_input_tokens"]
            + usage["cache_creation_input_tokens"]
        )

    first = _messages(server, body)
    assert first.status_code == 200, first.text
    cold = first.json()["usage"]
    assert cold["cache_read_input_tokens"] == 0 and cold["input_tokens"] == counted
    assert cold["output_tokens"] > 0
    warm = _messages(server, body).json()["usage"]
    assert 0 < warm["cache_read_input_tokens"] < counted
    assert 0 < warm["input_tokens"] < counted == prompt(warm)

    starts, deltas = [], []
    with httpx.stream(
        "POST", f"{server}/v1/messages", json={**body, "stream": True}, headers=AUTH, timeout=120
    ) as response:
        assert response.status_code == 200
        for event in sse_json(response.iter_lines()):
            if event["type"] == "message_start":
                starts.append(event["message"]["usage"])
            if event["type"] == "message_delta":
                deltas.append(event["usage"])
    assert len(deltas) == 1 and len(starts) == 1
    streamed = deltas[0]
    assert 0 < streamed["cache_read_input_tokens"] < counted == prompt(streamed)
    assert starts[0] == {**streamed, "output_tokens": 0}  # the cache hit from the start


def test_ignore_eos_lists_the_banned_end_tokens_in_logit_bias(server: str) -> None:
    """`generation_settings.logit_bias` is llama-server's `[{"bias", "token"}]`; with
    `ignore_eos` the end-of-generation tokens are there with bias null (-inf), otherwise not."""
    body: dict[str, Any] = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0.0}
    plain = httpx.post(f"{server}/completion", json=body, headers=AUTH, timeout=120)
    assert plain.status_code == 200, plain.text
    assert plain.json()["generation_settings"]["logit_bias"] == []
    ignoring = httpx.post(
        f"{server}/completion", json={**body, "ignore_eos": True}, headers=AUTH, timeout=120
    )
    assert ignoring.status_code == 200, ignoring.text
    settings = ignoring.json()["generation_settings"]
    assert settings["ignore_eos"] is True
    entries = settings["logit_bias"]
    assert entries and all(entry["bias"] is None for entry in entries)
    eos_text = httpx.get(f"{server}/props", headers=AUTH).json()["eos_token"]
    eos = httpx.post(
        f"{server}/tokenize", json={"content": eos_text, "parse_special": True}, headers=AUTH
    ).json()["tokens"]
    assert len(eos) == 1 and eos[0] in {entry["token"] for entry in entries}
    boosted = httpx.post(
        f"{server}/completion", json={**body, "logit_bias": [[7, 2.5]]}, headers=AUTH, timeout=120
    ).json()["generation_settings"]["logit_bias"]
    assert boosted == [{"bias": 2.5, "token": 7}]


@pytest.mark.parametrize("key", ["²", "٣", "1_000", "7 ", "0x7"])
def test_logit_bias_keys_that_are_not_decimal_ids(server: str, key: str) -> None:
    """A key is a token id only as llama-server's strtol reads one (whitespace, sign, ASCII
    digits to its end). `²` was a 500 on /completion (`isdigit` let it through to `int`);
    `٣` and `1_000` became ids 3 and 1000 (Python's `int`). /completion biases such a key's
    text tokens; the OpenAI routes, which take ids only, refuse it."""
    body: dict[str, Any] = {"prompt": "Once upon a time", "n_predict": 1, "logit_bias": {key: 2}}
    native = httpx.post(f"{server}/completion", json=body, headers=AUTH, timeout=120)
    assert native.status_code == 200, native.text
    text_ids = httpx.post(
        f"{server}/tokenize", json={"content": key}, headers=AUTH, timeout=120
    ).json()["tokens"]
    biased = native.json()["generation_settings"]["logit_bias"]
    assert biased == [{"bias": 2.0, "token": t} for t in dict.fromkeys(text_ids)]
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "logit_bias": {key: 2},
        },
        headers=AUTH,
        timeout=120,
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["message"] == f"logit_bias: keys must be token ids, not {key!r}"
    assert httpx.get(f"{server}/health").status_code == 200


def test_logit_bias_keys_read_as_strtol_does(server: str) -> None:
    body: dict[str, Any] = {"prompt": "Once upon a time", "n_predict": 1}
    for key in (" 7", "+7", "7"):
        native = httpx.post(
            f"{server}/completion", json={**body, "logit_bias": {key: 2}}, headers=AUTH, timeout=120
        )
        assert native.json()["generation_settings"]["logit_bias"] == [{"bias": 2.0, "token": 7}]
