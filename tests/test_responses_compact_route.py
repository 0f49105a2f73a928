"""POST /v1/responses/compact through the HTTP stack, and replaying its output.

The stand-in engine of `test_responses_api` answers every generation (the summary too)
with scripted tokens; the tokenizer and Qwen-style template are the tiny fixture's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sse_reader import sse_events
from test_responses_api import make_app, prompts, run

SUMMARY = ["They", " talked", " about", " trains", "."]


def _history(turns: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        items.append({"role": "user", "content": f"Question {i}: " + "tell me more " * 12})
        items.append({"role": "assistant", "content": f"Answer {i}: " + "more words " * 12})
    items.append({"role": "user", "content": "And finally?"})
    return items


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def call(_: Any, http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, json=body)

    return run(app, call)  # type: ignore[no-any-return]


def _get(app: Any, path: str) -> httpx.Response:
    async def call(_: Any, http: httpx.AsyncClient) -> httpx.Response:
        return await http.get(path)

    return run(app, call)  # type: ignore[no-any-return]


def _compact_sdk(app: Any, history: list[dict[str, Any]], **extra: Any) -> Any:
    """`client.responses.compact` (the official SDK method) against `app`."""

    async def call(client: AsyncOpenAI, _: Any) -> Any:
        items: Any = history  # plain dicts, as a client would send them
        return await client.responses.compact(model="m", input=items, extra_body=extra)

    return run(app, call)


def test_compaction_round_trip(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    history = _history(6)
    full = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": history}).json()
    compacted = _compact_sdk(app, history, keep_tokens=40)
    assert compacted.object == "response.compaction" and compacted.model == "m"
    output = [item.model_dump(mode="json", exclude_none=True, warnings=False) for item in
              compacted.output]  # fmt: skip
    assert output[0]["role"] == "system"
    assert output[0]["content"] == [{"type": "input_text", "text": "You are terse."}]
    compaction = output[-1]
    assert compaction["type"] == "compaction" and compaction["encrypted_content"]
    assert [item["type"] for item in output].count("compaction") == 1
    assert any(
        item.get("role") == "user" and "And finally?" in str(item.get("content")) for item in output
    )
    # The summary came from one generation whose prompt held the old turns as a transcript.
    assert len(engine.requests) == 1
    assert "Question 0" in prompts(hf_tokenizer, engine)[-1]
    usage = compacted.usage
    assert usage.input_tokens == len(engine.requests[0].prompt_tokens)
    assert usage.output_tokens == len(SUMMARY)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # Nothing was stored: neither the compaction id nor the compaction item.
    assert _get(app, f"/v1/responses/{compacted.id}").status_code == 404
    assert _get(app, f"/v1/responses/{compaction['id']}").status_code == 404

    # The compacted history goes back in, with a new question: accepted, and shorter.
    follow = [*output, {"role": "user", "content": "Thanks!"}]

    async def count(client: AsyncOpenAI, _: Any) -> int:
        counted = await client.responses.input_tokens.count(model="m", input=follow)  # type: ignore[arg-type]
        return counted.input_tokens

    counted = run(app, count)
    assert 0 < counted < full["input_tokens"]
    created = _post(app, "/v1/responses", {"model": "m", "input": follow})
    assert created.status_code == 200, created.text
    assert created.json()["usage"]["input_tokens"] == counted  # counted as create renders it
    prompt = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in prompt and "Question 0" not in prompt
    assert prompt.count("And finally?") == 1  # the kept user message is not duplicated
    assert prompt.count("You are terse.") == 1

    # Along a previous_response_id chain the compaction item replays too.
    first = _post(app, "/v1/responses", {"model": "m", "input": follow}).json()
    _post(app, "/v1/responses", {"model": "m", "previous_response_id": first["id"], "input": "ok"})
    chained = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in chained and "Question 0" not in chained
    assert chained.count("And finally?") == 1 and "Thanks!" in chained


def test_compact_summary_ignores_responses_fields(hf_tokenizer: Any) -> None:
    """Fields a client sends along (tools, text, reasoning, store...) never reach the summary;
    sampling fields do, and the summary never thinks."""
    app, engine = make_app(hf_tokenizer, SUMMARY)
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    body = {
        "model": "m",
        "input": _history(6),
        "keep_tokens": 40,
        "tools": tools,
        "parallel_tool_calls": True,
        "reasoning": {"effort": "low"},
        "text": {"format": {"type": "json_object"}},
        "store": True,
        "prompt_cache_key": "k",
        "temperature": 0.25,
        "top_k": 7,
    }
    answer = _post(app, "/v1/responses/compact", body)
    assert answer.status_code == 200, answer.text
    (request,) = engine.requests
    prompt = prompts(hf_tokenizer, engine)[0]
    assert "get_weather" not in prompt and "<tools>" not in prompt
    assert request.sampling.temperature == 0.25 and request.sampling.top_k == 7
    assert _get(app, f"/v1/responses/{answer.json()['id']}").status_code == 404


def test_compact_client_gone_is_499(hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.server.openai_responses.serving import ResponsesServing

    async def gone(*_: Any, **__: Any) -> None:
        return None  # what generate_text answers when the client disconnected

    monkeypatch.setattr(ResponsesServing, "generate_text", gone)
    app, _ = make_app(hf_tokenizer, SUMMARY)
    answer = _post(app, "/v1/responses/compact", {"model": "m", "input": _history(6)})
    assert answer.status_code == 499


def test_compact_route_is_not_the_retrieve_route(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, SUMMARY)
    for path in ("/v1/responses/compact", "/responses/compact"):
        answer = _post(app, path, {"model": "m", "input": _history(6), "keep_tokens": 40})
        assert answer.status_code == 200, answer.text
        assert answer.json()["object"] == "response.compaction"
    assert _post(app, "/v1/responses/compact", {"model": "m"}).status_code == 400


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
    # Usage is the answer's: its prompt is the compacted history, shorter than the input.
    full = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": _history(6)}).json()
    usage = out["usage"]
    assert usage["input_tokens"] == len(engine.requests[1].prompt_tokens) < full["input_tokens"]
    assert usage["output_tokens"] == len(SUMMARY)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    answer_prompt = prompts(hf_tokenizer, engine)[-1]
    assert "They talked about trains." in answer_prompt and "Question 0" not in answer_prompt
    # Bounded by the room left in the context.
    assert engine.requests[-1].max_tokens is not None
    assert engine.requests[-1].max_tokens <= 4096 - len(engine.requests[-1].prompt_tokens)
    # The stored answer chains: its compaction item replays along previous_response_id.
    _post(app, "/v1/responses", {"model": "m", "previous_response_id": out["id"], "input": "ok"})
    assert "Question 0" not in prompts(hf_tokenizer, engine)[-1]


def test_context_management_max_output_tokens_gives_incomplete(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    body = {
        "model": "m",
        "input": _history(6),
        "context_management": MANAGED,
        "max_output_tokens": 2,
    }
    out = _post(app, "/v1/responses", body).json()
    assert out["output"][0]["type"] == "compaction"
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert engine.requests[-1].max_tokens == 2 and out["usage"]["output_tokens"] == 2


def test_context_management_answer_is_bounded_by_the_context_left(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    counted = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": "Hi"}).json()
    engine.context_per_slot = counted["input_tokens"] + 2  # room for two tokens only
    managed = [{"type": "compaction"}]  # no threshold: only when the context is full
    out = _post(app, "/v1/responses", {"model": "m", "input": "Hi", "context_management": managed})
    body = out.json()
    assert [i["type"] for i in body["output"]] == ["message"]  # nothing to compact
    assert engine.requests[-1].max_tokens == 2
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_context_management_without_room_or_anything_to_compact_is_400(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    counted = _post(app, "/v1/responses/input_tokens", {"model": "m", "input": "Hi"}).json()
    engine.context_per_slot = counted["input_tokens"]  # no room to answer
    managed = [{"type": "compaction", "compact_threshold": 1}]
    out = _post(app, "/v1/responses", {"model": "m", "input": "Hi", "context_management": managed})
    assert out.status_code == 400
    assert out.json()["error"]["code"] == "context_length_exceeded"
    assert not engine.requests


def test_context_management_below_the_threshold_does_nothing(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, SUMMARY)
    managed = [{"type": "compaction", "compact_threshold": 100000}]
    out = _post(app, "/v1/responses", {"model": "m", "input": "Hi", "context_management": managed})
    assert [i["type"] for i in out.json()["output"]] == ["message"]
    assert len(engine.requests) == 1


def test_context_management_streams_compaction_events(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, SUMMARY)
    body = {"model": "m", "input": _history(6), "context_management": MANAGED, "stream": True}
    events = [(e.name, e.json()) for e in sse_events(_post(app, "/v1/responses", body).text)]
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "mlx.compaction.started"]
    started, done = dict(events)["mlx.compaction.started"], dict(events)["mlx.compaction.completed"]
    assert started["input_tokens_before"] == done["input_tokens_before"]
    assert 0 < done["input_tokens_after"] < done["input_tokens_before"]
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
