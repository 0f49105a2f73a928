"""POST /v1/responses/compact through the HTTP stack, and replaying its output.

The stand-in engine of `test_responses_api` answers every generation (the summary too)
with scripted tokens; the tokenizer and Qwen-style template are the tiny fixture's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from test_responses_api import make_app, prompts, run

SUMMARY = ["They", " talked", " about", " trains", "."]


def _history(turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        items.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 12})
        items.append({"role": "assistant", "content": f"Answer {i}: " + "more words " * 12})
    items.append({"role": "user", "content": "And finally?"})
    return items


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def call(_: Any, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, json=body)

    return run(app, call)  # type: ignore[no-any-return]


def _get(app: Any, path: str) -> httpx.Response:
    async def call(_: Any, http: httpx.AsyncClient) -> httpx.Response:
        return await http.get(path)

    return run(app, call)  # type: ignore[no-any-return]


def test_compaction_round_trip(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    history = _history(6)
    full = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": history}).json()
    answer = _post(
        app, "/v1/responses/compact", {"model": "m", "input": history, "keep_tokens": 40}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "response.compaction"
    output = body["output"]
    assert output[0]["role"] == "system" and "You are terse." in str(output[0]["content"])
    compaction = output[-1]
    assert compaction["type"] == "compaction" and compaction["encrypted_content"]
    assert any(
        item.get("role") == "user" and "And finally?" in str(item.get("content")) for item in output
    )
    # The summary came from one generation whose prompt held the old turns as a transcript.
    assert "Question 0" in prompts(hf_tokenizer, engine)[-1]
    assert body["usage"]["input_tokens"] > 0
    # Nothing was stored.
    assert _get(app, f"/v1/responses/{body['id']}").status_code == 404

    # The compacted history goes back in, with a new question: accepted, and shorter.
    follow = [*output, {"role": "user", "content": "Thanks!"}]
    counted = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": follow}).json()
    assert counted["input_tokens"] < full["input_tokens"]
    created = _post(app, "/v1/responses", {"model": "m", "input": follow})
    assert created.status_code == 200, created.text
    prompt = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in prompt and "Question 0" not in prompt
    assert prompt.count("And finally?") == 1  # the kept user message is not duplicated

    # Along a previous_response_id chain the compaction item replays too.
    first = _post(app, "/v1/responses", {"model": "m", "input": follow}).json()
    _post(app, "/v1/responses", {"model": "m", "previous_response_id": first["id"], "input": "ok"})
    chained = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in chained and "Question 0" not in chained


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"stream": True}, "stream"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"conversation": "conv_x"}, "conversation"),
        ({"keep_tokens": 0}, "keep_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 16385}, "max_output_tokens"),
    ],
)
def test_compact_request_rules(hf_tokenizer: Any, extra: dict[str, Any], fragment: str) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    answer = _post(app, "/v1/responses/compact", {"model": "m", "input": _history(2), **extra})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"]
    assert not engine.requests  # nothing ran


def test_history_longer_than_the_context_is_400(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    engine.context_per_slot = 256
    answer = _post(app, "/v1/responses/compact", {"model": "m", "input": _history(8)})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert not engine.requests


def test_result_not_shorter_is_400(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["word " * 400])  # a summary longer than what it replaces
    answer = _post(app, "/v1/responses/compact", {"model": "m", "input": _history(1)})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"


def test_malformed_compaction_item_is_400(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, SUMMARY)
    bad = [
        {"type": "compaction", "encrypted_content": "not-a-capsule"},
        {"role": "user", "content": "x"},
    ]
    answer = _post(app, "/v1/responses", {"model": "m", "input": bad})
    assert answer.status_code == 400
