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


def _sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    import json

    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(ln.split(": ", 1) for ln in block.split("\n") if not ln.startswith(":"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


MANAGED = [{"type": "compaction", "compact_threshold": 60}]


def test_context_management_compacts_before_answering(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    body = {"model": "m", "input": _history(6), "context_management": MANAGED}
    answer = _post(app, "/v1/responses", body)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["output"][0]["type"] == "compaction"
    assert out["output"][1]["type"] == "message" and out["status"] == "completed"
    assert len(engine.requests) == 2  # the summary, then the answer
    answer_prompt = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in answer_prompt and "Question 0" not in answer_prompt
    # Bounded by the room left in the context.
    assert engine.requests[-1].max_tokens is not None
    assert engine.requests[-1].max_tokens <= 4096 - len(engine.requests[-1].prompt_tokens)
    # The stored answer chains: its compaction item replays along previous_response_id.
    _post(app, "/v1/responses", {"model": "m", "previous_response_id": out["id"], "input": "ok"})
    assert "Question 0" not in prompts(hf_tokenizer, engine)[-1]


def test_context_management_below_the_threshold_does_nothing(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    managed = [{"type": "compaction", "compact_threshold": 100000}]
    out = _post(app, "/v1/responses", {"model": "m", "input": "Hi", "context_management": managed})
    assert [i["type"] for i in out.json()["output"]] == ["message"]
    assert len(engine.requests) == 1


def test_context_management_streams_compaction_events(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, SUMMARY)
    body = {"model": "m", "input": _history(6), "context_management": MANAGED, "stream": True}
    events = _sse(_post(app, "/v1/responses", body).text)
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "mlx.compaction.started"]
    done = dict(events)["mlx.compaction.completed"]
    assert done["input_tokens_after"] < done["input_tokens_before"]
    assert names.index("mlx.compaction.completed") < names.index("response.output_text.delta")
    assert names[-1] == "response.completed"
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["output"][0]["type"] == "compaction"


@pytest.mark.parametrize(
    "value",
    [
        {"type": "compaction"},
        [{"type": "other"}],
        [{"type": "compaction", "compact_threshold": 0}],
        [{"type": "compaction", "compact_threshold": 100000001}],
    ],
)
def test_bad_context_management_is_400(hf_tokenizer: Any, value: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    out = _post(app, "/v1/responses", {"model": "m", "input": "Hi", "context_management": value})
    assert out.status_code == 400, out.text
    assert not engine.requests


def test_compact_on_a_real_server(tiny_llama_dir: Path) -> None:
    from server_harness import AUTH, main_server_args, shared_server

    server = shared_server(main_server_args(tiny_llama_dir))
    history = _history(4)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        body = {"model": "m", "input": history, "max_output_tokens": 8, "keep_tokens": 30}
        answer = http.post("/v1/responses/compact", json=body)
        assert answer.status_code == 200, answer.text
        output = answer.json()["output"]
        assert output[-1]["type"] == "compaction"
        follow = {"model": "m", "input": [*output, {"role": "user", "content": "Hi"}]}
        counted = http.post("/v1/responses/input_tokens", json=follow).json()["input_tokens"]
        full = http.post("/v1/responses/input_tokens", json={"model": "m", "input": history})
        assert counted < full.json()["input_tokens"]
        created = http.post("/v1/responses", json={**follow, "max_output_tokens": 3})
        assert created.status_code == 200, created.text
