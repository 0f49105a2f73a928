"""OpenAI Responses API (/v1/responses) through the official `openai` SDK.

Most tests run the real HTTP stack over an ASGI transport with a stand-in engine that
answers scripted tokens (the pattern of test_server_tools.py: the tiny llama tokenizer with
a Qwen-style template, `<tool_call>` JSON and `<think>` reasoning). Streaming cancellation
runs under a real uvicorn (an ASGI transport buffers whole responses), and one test drives
a real `mlxcel serve` process on the tiny random-weight model.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fixtures.stand_in_engine import StandInEngine
from openai import AsyncOpenAI, OpenAI
from server_harness import API_KEY, InProcessServer, main_server_args, shared_server
from test_server_tools import CALL_TOKENS, QWEN_STYLE_TEMPLATE, THINK_TOKENS, opt_in_thinking

from mlxcel.config import Settings
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings
from mlxcel.server.app import create_app
from mlxcel.server.bridge import EngineClient
from mlxcel.server.openai_responses.items import input_items, items_to_messages
from mlxcel.server.openai_responses.store import stores_for
from mlxcel.server.state import ServerState

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": PARAMETERS,
    "strict": False,
}
TIME_TOOL: Any = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
THINKING: Any = {"chat_template_kwargs": {"enable_thinking": True}}
REQUIRED_DIRECTIVE = "You must call at least one of the provided functions."
NAMED_DIRECTIVE = "You must call the function `get_weather`."
BUILTIN_TOOL_TYPES = [
    "web_search",
    "web_search_preview",
    "file_search",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "custom",
    "apply_patch",
    "function_shell",
    "local_shell",
]


class Engine(StandInEngine):
    """Stands in for TextEngine: each request gets `tokens`, one event per token.

    `max_tokens` is honoured (finish `length`); with `delay` the tokens come from a thread,
    `delay` seconds apart and `repeat` times over, and `cancel` ends the job as `cancelled`.
    """

    context_per_slot = 4096

    def __init__(self, tokens: Sequence[str], *, delay: float = 0.0, repeat: int = 1) -> None:
        self.tokens = list(tokens)
        self.delay = delay
        self.repeat = repeat
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self._stops: dict[str, threading.Event] = {}

    def _run(self, request: GenerationRequest, sink: Any, stop: threading.Event) -> None:
        tokens = self.tokens * self.repeat
        limit = request.max_tokens if request.max_tokens is not None else len(tokens)
        sent = 0
        for i, text in enumerate(tokens[:limit]):
            if self.delay and stop.wait(self.delay):
                break
            sink(GenerationEvent(request.request_id, text=text, token_ids=(10 + i,)))
            sent += 1
        reason = "length" if limit < len(tokens) else "stop"
        if stop.is_set():
            reason = "cancelled"
        sink(
            GenerationEvent(
                request.request_id,
                finish_reason=reason,  # type: ignore[arg-type]
                prompt_tokens=len(request.prompt_tokens),
                completion_tokens=sent,
                timings=Timings(cache_n=3),
            )
        )

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        self.requests.append(request)
        stop = self._stops[request.request_id] = threading.Event()
        if self.delay:
            threading.Thread(target=self._run, args=(request, sink, stop), daemon=True).start()
        else:
            self._run(request, sink, stop)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        if request_id in self._stops:
            self._stops[request_id].set()

    def stop(self) -> None:
        for event in self._stops.values():
            event.set()


def make_state(hf_tokenizer: Any, engine: Engine, **settings: Any) -> ServerState:
    from mlxcel.engine.tokenizer import Tokenizer

    state = ServerState(
        settings=Settings(warmup=False, **opt_in_thinking(settings)),
        tokenizer=Tokenizer(hf_tokenizer, chat_template=QWEN_STYLE_TEMPLATE),
    )
    state.client = EngineClient(engine)
    return state


def make_app(hf_tokenizer: Any, tokens: Sequence[str], **settings: Any) -> tuple[Any, Engine]:
    engine = Engine(tokens)
    return create_app(make_state(hf_tokenizer, engine, **settings)), engine


def run(app: Any, call: Any) -> Any:
    """`await call(client, http)`: an SDK client and a raw httpx client bound to `app`."""

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            client = AsyncOpenAI(
                api_key="x",
                base_url="http://t/v1",
                http_client=http,  # type: ignore[arg-type]
                max_retries=0,
            )
            return await call(client, http)

    return asyncio.run(go())


def create(app: Any, **kwargs: Any) -> Any:
    async def call(client: AsyncOpenAI, _: Any) -> Any:
        return await client.responses.create(model="m", **kwargs)

    return run(app, call)


def prompts(hf_tokenizer: Any, engine: Engine) -> list[str]:
    return [hf_tokenizer.decode(r.prompt_tokens) for r in engine.requests]


def dump(response: Any) -> dict[str, Any]:
    return dict(response.model_dump(mode="json", exclude_none=True))


def same_shape(item: Any) -> dict[str, Any]:
    """An output item without its random ids."""
    out = {k: v for k, v in dump(item).items() if k not in ("id", "call_id")}
    return out


def raw_events(app: Any, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of every SSE message of a streamed create."""

    async def call(_: Any, http: httpx.AsyncClient) -> str:
        answer = await http.post("/v1/responses", json={"model": "m", "stream": True, **body})
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        return answer.text

    text = run(app, call)
    assert "[DONE]" not in text
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---------------------------------------------------------------------------- create


def test_string_input_gives_a_message_item(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["Hel", "lo", "!"])
    answer = create(app, input="Say hello", metadata={"k": "v"}, temperature=0.5)
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.status == "completed" and answer.error is None
    assert answer.output_text == "Hello!"
    (item,) = answer.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert [dump(p) for p in item.content] == [
        {"type": "output_text", "text": "Hello!", "annotations": []}
    ]
    usage = answer.usage
    assert usage.input_tokens == len(engine.requests[0].prompt_tokens)
    assert usage.output_tokens == 3 and usage.total_tokens == usage.input_tokens + 3
    assert usage.input_tokens_details.cached_tokens == 3
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert answer.metadata == {"k": "v"} and answer.temperature == 0.5
    assert dump(answer)["store"] is True and answer.truncation == "disabled"
    assert answer.tools == [] and answer.tool_choice == "auto"
    assert "<|im_start|>user\nSay hello<|im_end|>" in prompts(hf_tokenizer, engine)[0]


def test_item_list_roles_and_instructions(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])
    create(
        app,
        instructions="Be terse.",
        input=[
            {"role": "developer", "content": "Use metric units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "A"}]},
            {"role": "assistant", "content": "B"},
            {"role": "user", "content": [{"type": "input_text", "text": "C"}]},
        ],
    )
    prompt = prompts(hf_tokenizer, engine)[0]
    order = [
        "<|im_start|>system\nBe terse.",
        "<|im_start|>system\nUse metric units.",
        "<|im_start|>user\nA",
        "<|im_start|>assistant\nB",
        "<|im_start|>user\nC",
    ]
    positions = [prompt.index(piece) for piece in order]
    assert positions == sorted(positions)


def test_previous_output_can_be_sent_back_as_input(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, THINK_TOKENS)
    first = create(app, input="first question", extra_body=THINKING)
    assert [item.type for item in first.output] == ["reasoning", "message"]
    history = [
        {"role": "user", "content": "first question"},
        *[dump(item) for item in first.output],
        {"role": "user", "content": "second question"},
    ]
    second = create(app, input=history)
    assert second.status == "completed"
    prompt = prompts(hf_tokenizer, engine)[1]
    assert "<|im_start|>assistant\nHi!<|im_end|>" in prompt
    assert prompt.index("first question") < prompt.index("Hi!") < prompt.index("second question")


def test_refusal_parts_replay_as_assistant_text() -> None:
    items = input_items(
        [
            {
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "a", "annotations": []},
                    {"type": "refusal", "refusal": "no"},
                ],
            }
        ]
    )
    assert items_to_messages(items) == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "no"}],
        }
    ]


def test_items_become_chat_messages() -> None:
    items = input_items(
        [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
                {"type": "reasoning_text", "text": "look it up"}]},
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "20C"},
            {"type": "function_call_output", "call_id": "c2", "output": [
                {"type": "input_text", "text": "noon"}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]},
        ]
    )  # fmt: skip
    assert items_to_messages(items) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "reasoning_content": "look it up",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "20C", "name": "get_weather"},
        {
            "role": "tool",
            "tool_call_id": "c2",
            "content": [{"type": "text", "text": "noon"}],
            "name": "get_time",
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]


def test_compaction_items_use_the_compaction_module(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "mlxcel.server.openai_responses.compaction"
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": "e30"}
    fake = types.ModuleType(name)
    seen: list[dict[str, Any]] = []

    def compaction_item_messages(it: dict[str, Any]) -> list[dict[str, Any]]:
        seen.append(it)
        return [{"role": "system", "content": "summary"}]

    fake.compaction_item_messages = compaction_item_messages  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, fake)
    messages = items_to_messages(input_items([item, {"role": "user", "content": "go"}]))
    assert messages == [
        {"role": "system", "content": "summary"},
        {"role": "user", "content": "go"},
    ]
    assert seen == [item]

    monkeypatch.setitem(sys.modules, name, None)  # the module is missing: 400
    with pytest.raises(Exception) as caught:
        items_to_messages(input_items([item]))
    assert getattr(caught.value, "status", None) == 400


# ---------------------------------------------------------------------------- streaming


def test_stream_helper_event_order_and_final_response(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, THINK_TOKENS + CALL_TOKENS)
    kwargs: dict[str, Any] = {"input": "Weather in Paris?", "tools": [TOOL], "extra_body": THINKING}

    async def call(client: AsyncOpenAI, _: Any) -> tuple[list[Any], Any, str]:
        async with client.responses.stream(model="m", **kwargs) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        return events, final, text

    events, final, text = run(app, call)
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    types_ = [e.type for e in events]
    assert types_[:2] == ["response.created", "response.in_progress"]
    assert types_[-1] == "response.completed"
    reasoning_deltas = types_.count("response.reasoning_text.delta")
    text_deltas = types_.count("response.output_text.delta")
    args_deltas = types_.count("response.function_call_arguments.delta")
    assert reasoning_deltas and text_deltas and args_deltas
    assert types_[2:-1] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * reasoning_deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * text_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * args_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert text == final.output_text == "Hi!I will check."
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    for event in events:
        if hasattr(event, "output_index") and hasattr(event, "item_id"):
            assert event.item_id == final.output[event.output_index].id

    plain = create(app, **kwargs)
    assert [same_shape(o) for o in plain.output] == [same_shape(o) for o in final.output]
    assert plain.usage == final.usage and plain.status == final.status


def test_raw_sse_has_typed_event_lines(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["a", "b"])
    events = raw_events(app, {"input": "x"})
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [d for _, d in events if d["type"] == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["a", "b"]
    assert all(d["content_index"] == 0 and d["output_index"] == 0 for d in deltas)
    assert events[-1][1]["response"]["status"] == "completed"


def test_streamed_create_iterates_typed_events(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["x", "y"])

    async def call(client: AsyncOpenAI, _: Any) -> list[Any]:
        stream = await client.responses.create(model="m", input="q", stream=True)
        return [event async for event in stream]

    events = run(app, call)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "xy"


def test_reasoning_item_streams_reasoning_text(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, THINK_TOKENS)
    events = raw_events(app, {"input": "q", **THINKING})
    reasoning = [d for _, d in events if d["type"] == "response.reasoning_text.delta"]
    assert "".join(d["delta"] for d in reasoning) == "Let me think."
    assert all(d["output_index"] == 0 and d["content_index"] == 0 for d in reasoning)
    done = next(d for _, d in events if d["type"] == "response.reasoning_text.done")
    assert done["text"] == "Let me think."
    final = events[-1][1]["response"]
    reasoning_item, message = final["output"]
    assert reasoning_item["type"] == "reasoning" and reasoning_item["id"].startswith("rs_")
    assert reasoning_item["summary"] == []
    assert reasoning_item["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert message["content"][0]["text"] == "Hi!"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


# ---------------------------------------------------------------------------- tools


def test_function_tool_call_item(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    answer = create(app, input="Weather in Paris?", tools=[TOOL])
    message, call = answer.output
    assert message.type == "message" and answer.output_text == "I will check."
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert answer.tools[0].name == "get_weather"
    prompt = prompts(hf_tokenizer, engine)[0]
    assert '"name": "get_weather"' in prompt and "Current weather of a city" in prompt


def test_function_call_output_round_trip(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    first = create(app, input="Weather in Paris?", tools=[TOOL])
    call = first.output[1]
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        *[dump(item) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ]
    create(app, input=follow_up, tools=[TOOL])
    prompt = prompts(hf_tokenizer, engine)[1]
    assert '<|im_start|>tool\n{"temp": 21}<|im_end|>' in prompt
    assert "<|im_start|>assistant\nI will check.<|im_end|>" in prompt


@pytest.mark.parametrize(
    ("choice", "directive"),
    [
        ("required", REQUIRED_DIRECTIVE),
        ({"type": "any"}, REQUIRED_DIRECTIVE),
        ({"type": "function", "name": "get_weather"}, NAMED_DIRECTIVE),
    ],
)
def test_forced_tool_choice(hf_tokenizer: Any, choice: Any, directive: str) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    answer = create(app, input="Weather?", tools=[TOOL, TIME_TOOL], tool_choice=choice)
    assert answer.output[-1].type == "function_call"
    prompt = prompts(hf_tokenizer, engine)[0]
    assert directive in prompt
    assert engine.requests[0].grammar is not None  # the call grammar constrains decoding
    named = isinstance(choice, dict) and choice["type"] == "function"
    assert ('"name": "get_time"' in prompt) is not named  # a named choice narrows the tools


def test_tool_choice_none_renders_no_tools(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    answer = create(app, input="Weather?", tools=[TOOL], tool_choice="none")
    assert [item.type for item in answer.output] == ["message"]
    assert "<tool_call>" in answer.output_text
    assert "get_weather" not in prompts(hf_tokenizer, engine)[0]
    assert answer.tool_choice == "none"


def test_allowed_tools_narrows_the_list(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])
    choice = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "get_time"}],
    }
    create(app, input="x", tools=[TOOL, TIME_TOOL], extra_body={"tool_choice": choice})
    prompt = prompts(hf_tokenizer, engine)[0]
    assert "get_time" in prompt and "get_weather" not in prompt


# ---------------------------------------------------------------------------- output control


def test_text_format_json_schema_compiles_a_grammar(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ['{"city":', ' "Oslo"}'])
    fmt = {"type": "json_schema", "name": "City", "schema": PARAMETERS, "strict": True}
    answer = create(app, input="A city", text={"format": fmt})
    assert json.loads(answer.output_text) == {"city": "Oslo"}
    assert engine.requests[0].grammar is not None
    assert answer.text.format.type == "json_schema"
    create(app, input="A city", text={"format": {"type": "text"}})
    assert engine.requests[1].grammar is None


def test_parse_with_a_pydantic_text_format(hf_tokenizer: Any) -> None:
    from pydantic import BaseModel

    class City(BaseModel):
        city: str

    app, engine = make_app(hf_tokenizer, ['{"city": "Oslo"}'])

    async def call(client: AsyncOpenAI, _: Any) -> Any:
        return await client.responses.parse(model="m", input="A city", text_format=City)

    parsed = run(app, call)
    assert parsed.output_parsed == City(city="Oslo")
    assert engine.requests[0].grammar is not None


def test_max_output_tokens_gives_incomplete(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["a", "b", "c", "d"])
    answer = create(app, input="x", max_output_tokens=2)
    assert engine.requests[0].max_tokens == 2
    assert answer.status == "incomplete"
    assert answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text == "ab" and answer.output[0].status == "incomplete"
    assert answer.max_output_tokens == 2

    events = raw_events(app, {"input": "x", "max_output_tokens": 2})
    name, last = events[-1]
    assert name == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_sampling_extras_reach_the_engine(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])
    create(app, input="x", top_p=0.5, extra_body={"top_k": 7, "seed": 11})
    sampling = engine.requests[0].sampling
    assert (sampling.top_k, sampling.seed, sampling.top_p) == (7, 11, 0.5)


# ---------------------------------------------------------------------------- state


def test_previous_response_id_chains_the_exchange(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["first", " answer"])
    first = create(app, input="first question", instructions="OLD RULES")
    second = create(app, input="second question", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = prompts(hf_tokenizer, engine)[1]
    assert prompt.index("first question") < prompt.index("first answer")
    assert prompt.index("first answer") < prompt.index("second question")
    assert "OLD RULES" not in prompt  # instructions are not carried over
    third = create(app, input="third", previous_response_id=second.id)
    assert third.status == "completed"
    third_prompt = prompts(hf_tokenizer, engine)[2]
    assert third_prompt.count("first answer") == 2  # both earlier answers


def test_conversation_accumulates_items(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["reply"])
    one = create(app, input="alpha", conversation="conv_1")
    assert one.conversation is not None and one.conversation.id == "conv_1"
    create(app, input="beta", conversation="conv_1")
    create(app, input="gamma", conversation={"id": "conv_2"})
    create(app, input="delta", conversation="conv_1", store=False)
    texts = prompts(hf_tokenizer, engine)
    assert "alpha" in texts[1] and "beta" in texts[1] and texts[1].count("reply") == 1
    assert "alpha" not in texts[2]
    assert all(word in texts[3] for word in ("alpha", "beta")) and "gamma" not in texts[3]
    assert texts[3].count("reply") == 2


def test_retrieve_delete_and_cancel(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"])

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        made = await client.responses.create(model="m", input="x")
        got = await client.responses.retrieve(made.id)
        assert dump(got) == dump(made)
        bare = await http.get(f"/responses/{made.id}")  # the alias without /v1
        assert bare.status_code == 200 and bare.json()["id"] == made.id
        cancelled = await client.responses.cancel(made.id)
        assert cancelled.status == "cancelled" and cancelled.id == made.id
        assert (await client.responses.retrieve(made.id)).status == "cancelled"
        deleted = await http.delete(f"/v1/responses/{made.id}")
        assert deleted.json() == {"id": made.id, "object": "response", "deleted": True}
        for action in (
            client.responses.retrieve(made.id),
            client.responses.delete(made.id),
            client.responses.cancel(made.id),
        ):
            with pytest.raises(openai.NotFoundError) as caught:
                await action
            assert caught.value.body["type"] == "not_found_error"  # type: ignore[index]
        other = await client.responses.create(model="m", input="y")
        await client.responses.delete(other.id)  # the SDK's own delete call
        assert (await http.post(f"/responses/{other.id}/cancel")).status_code == 404

    run(app, call)


def test_store_false_is_not_kept(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"])

    async def call(client: AsyncOpenAI, _: Any) -> None:
        made = await client.responses.create(model="m", input="x", store=False)
        assert dump(made)["store"] is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.create(model="m", input="y", previous_response_id=made.id)
        assert caught.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]

    run(app, call)


def test_store_disabled_gives_400s(hf_tokenizer: Any) -> None:
    app, _ = make_app(
        hf_tokenizer, ["ok"], responses_store_max_entries=0, conversation_store_max_entries=0
    )

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        made = await client.responses.create(model="m", input="x")
        assert made.status == "completed" and dump(made)["store"] is False
        for method, path in (
            ("GET", f"/v1/responses/{made.id}"),
            ("DELETE", f"/v1/responses/{made.id}"),
            ("POST", f"/v1/responses/{made.id}/cancel"),
        ):
            answer = await http.request(method, path)
            assert answer.status_code == 400, (method, answer.text)
            assert "disabled" in answer.json()["error"]["message"]
        for extra in ({"previous_response_id": made.id}, {"conversation": "c"}):
            answer = await http.post("/v1/responses", json={"input": "y", **extra})
            assert answer.status_code == 400 and "disabled" in answer.text

    run(app, call)


def test_lru_eviction_and_ttl_expiry_over_http(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"], responses_store_max_entries=2)
    stores = stores_for(app, app.state.mlxcel.settings)
    clock = [0.0]
    stores.responses.clock = lambda: clock[0]
    stores.responses.ttl = 60

    async def call(client: AsyncOpenAI, _: Any) -> None:
        a = await client.responses.create(model="m", input="a")
        b = await client.responses.create(model="m", input="b")
        await client.responses.retrieve(a.id)  # `a` becomes the most recently used
        c = await client.responses.create(model="m", input="c")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(b.id)  # evicted
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(model="m", input="d", previous_response_id=b.id)
        await client.responses.retrieve(a.id)
        clock[0] = 59.0
        await client.responses.retrieve(c.id)
        clock[0] = 60.0
        for gone in (a.id, c.id):
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(gone)  # expired

    run(app, call)


def test_input_tokens_counts_what_create_renders(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])

    async def call(client: AsyncOpenAI, http: httpx.AsyncClient) -> None:
        first = await client.responses.create(model="m", input="one")
        kwargs: dict[str, Any] = {
            "input": "two",
            "instructions": "Rules.",
            "tools": [TOOL],
            "tool_choice": "required",
            "previous_response_id": first.id,
        }
        counted = await client.responses.input_tokens.count(model="m", **kwargs)
        assert counted.object == "response.input_tokens"
        made = await client.responses.create(model="m", **kwargs)
        assert counted.input_tokens == len(engine.requests[1].prompt_tokens)
        assert counted.input_tokens == made.usage.input_tokens
        bare = await http.post("/responses/input_tokens", json={"input": "one"})
        assert bare.json() == {
            "object": "response.input_tokens",
            "input_tokens": len(engine.requests[0].prompt_tokens),
        }

    run(app, call)


def test_context_management_is_accepted_and_kept(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["ok"])
    cm = [{"type": "compaction", "compact_threshold": 1000}]
    answer = create(app, input="x", extra_body={"context_management": cm})
    assert answer.status == "completed"
    stores = stores_for(app, app.state.mlxcel.settings)
    stored = stores.responses.get(answer.id)
    assert stored is not None and stored.request == {"context_management": cm}


# ---------------------------------------------------------------------------- errors

FILE_PART = {"type": "input_file", "file_id": "f"}
BAD_BODIES: list[tuple[dict[str, Any], str]] = [
    ({"input": [{"role": "user", "content": [FILE_PART]}]}, "input_file"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "web_search_call"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"content": "no role"}]}, "type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": "x", "previous_response_id": "resp_x", "conversation": "c"}, "together"),
    ({"input": "x", "previous_response_id": "resp_missing"}, "not found"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, "required"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "nope"),
    ({"input": "x", "tools": [{"type": "function"}]}, "name"),
    ({"input": []}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "not supported"),
]  # fmt: skip
BAD_BODIES += [({"input": "x", "tools": [{"type": kind}]}, kind) for kind in BUILTIN_TOOL_TYPES]
# A type that is no string (a list or an object) was looked up in a dict: 500 TypeError.
BAD_BODIES += [
    (body, where)
    for kind in ([], {"a": 1}, ["input_text"])
    for body, where in (
        ({"input": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": "x", "tools": [{"type": kind, "name": "f"}]}, "tools[0].type"),
    )
]  # fmt: skip


@pytest.mark.parametrize(("body", "needle"), BAD_BODIES)
def test_unsupported_requests_are_400(hf_tokenizer: Any, body: dict[str, Any], needle: str) -> None:
    app, engine = make_app(hf_tokenizer, ["ok"])

    async def call(_: Any, http: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await http.post("/v1/responses", json=body),
            await http.post("/v1/responses", json={**body, "stream": True}),
        ]

    for answer in run(app, call):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert needle in error["message"] + str(error.get("param")), error
    assert engine.requests == []


# ---------------------------------------------------------------------------- real servers


def test_cancel_stops_a_streaming_response(hf_tokenizer: Any) -> None:
    engine = Engine(["tick "], delay=0.02, repeat=500)
    server = InProcessServer(Settings(warmup=False), state=make_state(hf_tokenizer, engine))
    with server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.responses.create(model="m", input="count", stream=True)
        seen: list[Any] = []
        cancelled: Any = None
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and cancelled is None:
                cancelled = client.responses.cancel(seen[0].response.id)
        assert cancelled is not None and cancelled.status == "cancelled"
        last = seen[-1]
        assert last.type == "response.incomplete" and last.response.status == "cancelled"
        assert engine.cancelled and len(engine.requests) == 1
        assert last.response.usage.output_tokens < 500
        stored = client.responses.retrieve(cancelled.id)
        assert stored.status == "cancelled" and stored.output_text == last.response.output_text
        assert stored.output_text.startswith("tick ")
        server.stop(stop_engine=False)


def test_cancel_stops_a_non_streamed_response(hf_tokenizer: Any) -> None:
    engine = Engine(["tick "], delay=0.02, repeat=500)
    app = create_app(make_state(hf_tokenizer, engine))
    stores = stores_for(app, app.state.mlxcel.settings)

    async def call(client: AsyncOpenAI, _: Any) -> tuple[Any, Any]:
        task = asyncio.ensure_future(client.responses.create(model="m", input="count"))
        while not stores.inflight:
            await asyncio.sleep(0.01)
        (response_id,) = stores.inflight
        while len(engine.requests) < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        cancelled = await client.responses.cancel(response_id)
        return cancelled, await task

    cancelled, made = run(app, call)
    assert cancelled.status == made.status == "cancelled"
    assert made.output_text.startswith("tick ") and made.usage.output_tokens < 500
    assert engine.cancelled == [engine.requests[0].request_id]
    assert stores.inflight == {}


def test_deleting_a_generating_response_keeps_it_deleted(hf_tokenizer: Any) -> None:
    engine = Engine(["tick "], delay=0.01, repeat=20)
    app = create_app(make_state(hf_tokenizer, engine))
    stores = stores_for(app, app.state.mlxcel.settings)

    async def call(client: AsyncOpenAI, _: Any) -> Any:
        task = asyncio.ensure_future(client.responses.create(model="m", input="count"))
        while not stores.inflight:
            await asyncio.sleep(0.01)
        (response_id,) = stores.inflight
        await client.responses.delete(response_id)
        made = await task
        assert made.id == response_id and made.status == "completed"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response_id)

    run(app, call)


def test_reusable_steps_for_compaction(hf_tokenizer: Any) -> None:
    from starlette.requests import Request

    from mlxcel.server.openai_responses.protocol import ResponsesRequest
    from mlxcel.server.openai_responses.serving import ResponsesServing

    engine = Engine(["<think>", "plan", "</think>", "Sum", "mary"])
    state = make_state(hf_tokenizer, engine)
    app = create_app(state)

    async def never_disconnects() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def go() -> tuple[int, Any, dict[str, Any]]:
        serving = ResponsesServing(state, stores_for(app, state.settings))
        raw = Request({"type": "http", "headers": []}, receive=never_disconnects)
        body = ResponsesRequest(instructions="Rules.", tools=[TOOL])
        items = input_items("hello")
        counted = await serving.count_tokens(body, items)
        route = await serving.input_tokens(
            ResponsesRequest(input="hello", instructions="Rules.", tools=[TOOL])
        )
        generated = await serving.generate_text([{"role": "user", "content": "sum up"}], 5, raw)
        return counted, generated, route

    counted, generated, route = asyncio.run(go())
    assert counted == route["input_tokens"] > 0
    assert generated.text == "Summary" and generated.reasoning == "plan"
    assert (generated.completion_tokens, generated.finish_reason) == (5, "stop")
    assert engine.requests[-1].max_tokens == 5


@pytest.fixture(scope="module")
def real_client(tiny_llama_dir: Path) -> Iterator[OpenAI]:
    server = shared_server(main_server_args(tiny_llama_dir))
    yield OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_real_server_with_the_sdk(real_client: OpenAI) -> None:
    client = real_client
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=3, temperature=0)
    assert first.status in ("completed", "incomplete")
    assert first.output and first.output[-1].type == "message"
    assert 0 < first.usage.output_tokens <= 3  # type: ignore[union-attr]
    assert client.responses.retrieve(first.id).output_text == first.output_text

    counted = client.responses.input_tokens.count(
        model="tiny", input="And now?", previous_response_id=first.id
    )
    stream = client.responses.create(
        model="tiny",
        input="And now?",
        previous_response_id=first.id,
        max_output_tokens=3,
        temperature=0,
        stream=True,
    )
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.usage.input_tokens == counted.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_trailing_assistant_item_starts_a_new_turn(hf_tokenizer: Any) -> None:
    """Unlike chat's prefill, a Responses history ending with the assistant gets a new turn."""
    app, engine = make_app(hf_tokenizer, ["ok"])
    create(
        app,
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello there"}]},
        ],
    )
    prompt = prompts(hf_tokenizer, engine)[0]
    assert prompt.endswith("Hello there<|im_end|>\n<|im_start|>assistant\n"), prompt
