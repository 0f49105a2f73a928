"""Anthropic Messages API (/v1/messages) through the official `anthropic` SDK.

Most tests run a stand-in engine with scripted tokens behind the real HTTP stack (no
socket), with the tiny llama fixture's tokenizer and the Qwen-style template of
`test_server_tools` (`<tool_call>` JSON, `<think>` reasoning), so the block mapping is
checked exactly. The last tests drive a real `mlxcel serve` on the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic import Anthropic, AsyncAnthropic
from fixtures.stand_in_engine import StandInEngine
from server_harness import API_KEY, ServeProcess
from test_server_tools import (
    CALL_TOKENS,
    QWEN_STYLE_TEMPLATE,
    THINK_TOKENS,
    THINKING_OPT_IN,
    opt_in_thinking,
)

from mlxcel.config import Settings
from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlxcel.engine.text.request import (
    GenerationEvent,
    GenerationRequest,
    PromptProgress,
    Timings,
)
from mlxcel.server.anthropic_messages.convert import (
    anthropic_tool_id,
    chat_call_id,
    to_chat_request,
)
from mlxcel.server.anthropic_messages.encoder import BlockEvents, stop_reason
from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
from mlxcel.server.app import create_app
from mlxcel.server.bridge import EngineClient
from mlxcel.server.errors import is_messages_path
from mlxcel.server.state import ServerState

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
WEB_SEARCH = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HELLO = ["Hel", "lo", " there", "!"]

# Renders everything the conversion hands the template: roles, tool ids, calls, reasoning.
ECHO_TEMPLATE = """\
{%- for message in messages %}<{{ message.role }}>
{%- if message.tool_call_id %}[result for {{ message.tool_call_id }}]{% endif %}
{%- if message.reasoning_content %}[think {{ message.reasoning_content }}]{% endif %}
{{- message.content }}
{%- for call in message.tool_calls or [] %}[call {{ call.id }} {{ call.function.name }} \
{{ call.function.arguments | tojson }}]{% endfor %}</{{ message.role }}>
{% endfor %}<assistant>"""


class Engine(StandInEngine):
    """Stands in for TextEngine: every request gets `tokens`, then one finishing event."""

    def __init__(
        self,
        tokens: Sequence[str],
        *,
        finish: str = "stop",
        stop_word: str | None = None,
        error: str | None = None,
    ) -> None:
        self.tokens = list(tokens)
        self.finish = finish
        self.stop_word = stop_word
        self.error = error
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        self.requests.append(request)
        for i, text in enumerate(self.tokens):
            sink(GenerationEvent(request.request_id, text=text, token_ids=(10 + i,)))
        sink(
            GenerationEvent(
                request.request_id,
                finish_reason=self.finish,  # type: ignore[arg-type]
                prompt_tokens=len(request.prompt_tokens),
                completion_tokens=len(self.tokens),
                stop_word=self.stop_word,
                error=self.error,
            )
        )


def make_state(
    hf_tokenizer: Any, engine: Engine | None, template: str = QWEN_STYLE_TEMPLATE, **settings: Any
) -> ServerState:
    from mlxcel.engine.tokenizer import Tokenizer

    if template == QWEN_STYLE_TEMPLATE:
        settings = opt_in_thinking(settings)
    state = ServerState(
        settings=Settings(warmup=False, **settings),
        tokenizer=Tokenizer(hf_tokenizer, chat_template=template),
    )
    if engine is not None:
        state.client = EngineClient(engine)
    return state


def make_app(
    hf_tokenizer: Any, tokens: Sequence[str], template: str = QWEN_STYLE_TEMPLATE, **options: Any
) -> tuple[Any, Engine]:
    settings = {k: options.pop(k) for k in ("api_key", "api_prefix") if k in options}
    engine = Engine(tokens, **options)
    return create_app(make_state(hf_tokenizer, engine, template, **settings)), engine


def run(app: Any, call: Any, *, api_key: str = "x", prefix: str = "") -> Any:
    """`await call(client)` with an AsyncAnthropic bound to `app` (no socket)."""

    async def go() -> Any:
        transport = httpx2.ASGITransport(app=app)
        base = f"http://t{prefix}"
        async with httpx2.AsyncClient(transport=transport, base_url=base) as http:
            client = AsyncAnthropic(api_key=api_key, base_url=base, http_client=http, max_retries=0)
            return await call(client)

    return asyncio.run(go())


def create(app: Any, **kwargs: Any) -> Any:
    async def call(client: AsyncAnthropic) -> Any:
        return await client.messages.create(model="m", **{"max_tokens": 64, **kwargs})

    return run(app, call)


def stream(app: Any, **kwargs: Any) -> tuple[list[Any], Any, str]:
    """(events, final message, text_stream text) of one `messages.stream` call."""

    async def call(client: AsyncAnthropic) -> tuple[list[Any], Any, str]:
        events: list[Any] = []
        async with client.messages.stream(model="m", **{"max_tokens": 64, **kwargs}) as s:
            async for event in s:
                events.append(event)
            final = await s.get_final_message()
        async with client.messages.stream(model="m", **{"max_tokens": 64, **kwargs}) as s:
            text = "".join([piece async for piece in s.text_stream])
        return events, final, text

    return run(app, call)  # type: ignore[no-any-return]


def post(app: Any, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    """A raw POST (no SDK): the httpx2 response, body read."""

    async def go() -> Any:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await http.post(path, content=content, headers=headers or {})

    return asyncio.run(go())


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event of a raw stream."""
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def prompt_of(hf_tokenizer: Any, engine: Engine, index: int = -1) -> str:
    return str(hf_tokenizer.decode(engine.requests[index].prompt_tokens))


def anthropic_error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind, body
    return str(body["error"]["message"])


# ----------------------------------------------------------------------- non-streamed


def test_create_text_message(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    # SDK 2.x no longer has sampling parameters: they travel in extra_body.
    message = create(
        app, messages=USER, system="Be terse.", max_tokens=32, extra_body={"temperature": 0.5}
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "m"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello there!"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == len(HELLO)
    assert message.usage.input_tokens == len(engine.requests[0].prompt_tokens)
    request = engine.requests[0]
    assert request.max_tokens == 32 and request.sampling.temperature == 0.5
    prompt = prompt_of(hf_tokenizer, engine)
    assert "<|im_start|>system\nBe terse.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_create_with_thinking_block(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, THINK_TOKENS)
    message = create(app, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Let me think."
    assert message.content[0].signature == ""
    assert message.content[1].text == "Hi!"
    # enabled -> enable_thinking: the generation prompt opens the block; the budget applies.
    assert prompt_of(hf_tokenizer, engine).endswith("<|im_start|>assistant\n<think>\n")
    thinking = engine.requests[0].thinking
    assert thinking is not None and thinking.tokens == 1024


def test_thinking_disabled_renders_without_think(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    create(app, messages=USER, thinking={"type": "disabled"})
    assert prompt_of(hf_tokenizer, engine).endswith("<|im_start|>assistant\n")
    assert engine.requests[0].thinking is None


def test_create_tool_use(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    message = create(app, messages=USER, tools=[WEATHER])
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "I will check."
    call = message.content[1]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "Paris"}
    assert engine.requests[0].skip_special is False  # markers must reach the parser


def test_max_tokens_and_stop_sequence_reasons(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO, finish="length")
    assert create(app, messages=USER).stop_reason == "max_tokens"
    app, engine = make_app(hf_tokenizer, HELLO, stop_word="END")
    message = create(app, messages=USER, stop_sequences=["END", "STOP"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "END"
    assert engine.requests[0].stop == ("END", "STOP")
    assert stop_reason("stop", False, "</s>", ["END"]) == ("end_turn", None)
    assert stop_reason("length", True, None, []) == ("max_tokens", None)
    assert stop_reason("stop", True, "END", ["END"]) == ("tool_use", None)


def test_empty_answer_has_one_empty_text_block(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, [])
    message = create(app, messages=USER)
    assert [(b.type, b.text) for b in message.content] == [("text", "")]


class CachingEngine(Engine):
    """As `Engine`, with `cached` prompt tokens served by the prompt cache: a prompt
    progress event first when the request asks for one (as the scheduler sends it at
    admission on a cache hit), and the count in the final event's timings."""

    def __init__(self, tokens: Sequence[str], cached: int) -> None:
        super().__init__(tokens)
        self.cached = cached

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        total = len(request.prompt_tokens)
        if request.progress:
            progress = PromptProgress(total, self.cached, self.cached, 0.0)
            sink(GenerationEvent(request.request_id, progress=progress))

        def timed(event: GenerationEvent) -> None:
            if event.finished:
                event.timings = Timings(prompt_n=total - self.cached, cache_n=self.cached)
            sink(event)

        super().submit(request, timed)


def test_usage_input_tokens_leave_out_cache_reads(hf_tokenizer: Any) -> None:
    """Anthropic's split, as llama-server's: input_tokens + cache_read_input_tokens +
    cache_creation_input_tokens is the prompt; message_start already has the cache reads."""
    engine = CachingEngine(HELLO, cached=5)
    app = create_app(make_state(hf_tokenizer, engine))
    message = create(app, messages=USER)
    prompt = len(engine.requests[0].prompt_tokens)
    expected = {
        "input_tokens": prompt - 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 5,
        "output_tokens": len(HELLO),
    }
    assert message.usage.model_dump(exclude_none=True) == expected
    assert engine.requests[0].progress is False  # collected: no progress events asked for
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": USER}
    events = sse_events(post(app, "/v1/messages", body).text)
    assert engine.requests[1].progress is True
    assert [name for name, _ in events[:2]] == ["message_start", "content_block_start"]
    assert events[0][1]["message"]["usage"] == {**expected, "output_tokens": 0}
    (delta,) = [data for name, data in events if name == "message_delta"]
    assert delta["usage"] == expected
    counted = post(app, "/v1/messages/count_tokens", {"model": "m", "messages": USER}).json()
    assert counted == {"input_tokens": prompt}  # count_tokens: the whole prompt


# --------------------------------------------------------------------------- streamed


def test_stream_text(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    events, final, text = stream(app, messages=USER)
    assert text == "Hello there!"
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason == "end_turn" and final.stop_sequence is None
    assert final.usage.output_tokens == len(HELLO)
    assert final.usage.input_tokens == len(engine.requests[0].prompt_tokens)
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert deltas == HELLO  # one delta per token, nothing held back


def test_stream_event_sequence_on_the_wire(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, THINK_TOKENS)
    body = {
        "model": "m",
        "max_tokens": 50,
        "stream": True,
        "messages": USER,
        "thinking": {"type": "enabled", "budget_tokens": 2000},
    }
    response = post(app, "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(engine.requests[0].prompt_tokens)
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [b["index"] for b in blocks] == [0, 1]
    assert blocks[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert blocks[1]["content_block"] == {"type": "text", "text": ""}
    # Every block is started, receives its deltas, and stops before the next one starts.
    body_names = names[1:-2]
    assert body_names[0] == "content_block_start" and body_names[-1] == "content_block_stop"
    assert body_names.count("content_block_stop") == 2
    thinking = "".join(
        d["delta"]["thinking"] for n, d in events if n == "content_block_delta" and d["index"] == 0
    )
    text = "".join(
        d["delta"]["text"] for n, d in events if n == "content_block_delta" and d["index"] == 1
    )
    assert thinking == "Let me think." and text == "Hi!"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(THINK_TOKENS)


def test_stream_thinking_deltas(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, THINK_TOKENS)
    events, final, text = stream(
        app, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in kinds and kinds.index("thinking_delta") < kinds.index("text_delta")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Let me think." and final.content[1].text == "Hi!"
    assert text == "Hi!"


def test_stream_tool_use_reassembles(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, CALL_TOKENS)
    events, final, text = stream(app, messages=USER, tools=[WEATHER])
    assert text == "I will check."
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"]
    assert starts[1].name == "get_weather" and starts[1].id.startswith("toolu_")
    assert starts[1].input == {}
    fragments = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(fragments) > 1  # the arguments stream as they are generated
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    call = final.content[1]
    assert call.type == "tool_use" and call.input == {"city": "Paris"} and call.id == starts[1].id


def test_stream_engine_error_is_an_error_event(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ["Hel"], finish="error", error="boom in /secret/path/x.py")
    with pytest.raises(anthropic.APIStatusError) as caught:
        stream(app, messages=USER)
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert "boom" in body["error"]["message"] and "/secret" not in body["error"]["message"]
    # Not streamed: a 500 in the same shape.
    app, _ = make_app(hf_tokenizer, ["Hel"], finish="error", error="boom")
    response = post(app, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER})
    assert "boom" in anthropic_error(response, 500, "api_error")


def test_block_events_route_fragments_to_their_block() -> None:
    blocks = BlockEvents()
    lines = blocks.feed(
        [
            ReasoningDelta("r"),
            ContentDelta("c"),
            ToolCallStart(0, "call_a", "f"),
            ToolCallArguments(0, "{}"),
            ToolCallEnd(0),
        ]
    )
    lines += blocks.close()
    events = sse_events("".join(lines))
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [d["index"] for n, d in events if n == "content_block_stop"] == [0, 1, 2]
    assert events[-2][1]["delta"] == {"type": "input_json_delta", "partial_json": "{}"}
    assert events[-2][1]["index"] == 2
    assert events[6][1]["content_block"]["id"] == "toolu_a"


# --------------------------------------------------------------- tools and the prompt


def test_tool_use_round_trip(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["It", " is", " sunny", "."], template=ECHO_TEMPLATE)
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_abc123",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_abc123",
                    "content": [{"type": "text", "text": "22C, sunny"}],
                },
            ],
        },
    ]
    message = create(app, messages=history, tools=[WEATHER])
    assert message.content[0].text == "It is sunny."
    prompt = prompt_of(hf_tokenizer, engine)
    assert '[call abc123 get_weather {"city": "Paris"}]' in prompt
    assert prompt.endswith("<tool>[result for abc123]22C, sunny</tool>\n<assistant>")
    # The turn in progress keeps its reasoning (a tool result is no new user query) ...
    assert "<assistant>[think Need the tool.]Checking.[call" in prompt
    # ... which a new user question in the same turn closes: earlier reasoning is dropped.
    history[-1]["content"].append({"type": "text", "text": "And tomorrow?"})
    create(app, messages=history, tools=[WEATHER])
    prompt = prompt_of(hf_tokenizer, engine)
    assert prompt.endswith("</tool>\n<user>And tomorrow?</user>\n<assistant>")
    assert "Need the tool." not in prompt and "<assistant>Checking.[call abc123" in prompt
    assert anthropic_tool_id("call_xyz") == "toolu_xyz" and chat_call_id("toolu_xyz") == "xyz"


@pytest.mark.parametrize(
    ("choice", "rendered", "directive"),
    [
        ({"type": "auto"}, {"get_weather", "get_time"}, None),
        ({"type": "any"}, {"get_weather", "get_time"}, "You must call at least one"),
        (
            {"type": "tool", "name": "get_time"},
            {"get_time"},
            "You must call the function `get_time`",
        ),
        ({"type": "none"}, set(), None),
    ],
)
def test_tool_choice_mapping(
    hf_tokenizer: Any, choice: dict[str, Any], rendered: set[str], directive: str | None
) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    create(app, messages=USER, tools=[WEATHER, TIME], tool_choice=choice)
    prompt = prompt_of(hf_tokenizer, engine)
    assert {name for name in ("get_weather", "get_time") if f'"{name}"' in prompt} == rendered
    if directive is None:
        assert "You must call" not in prompt
    else:
        assert directive in prompt
        assert engine.requests[0].grammar is not None  # forced: constrained by a call grammar


def test_disable_parallel_tool_use_and_choice_translation() -> None:
    def chat(choice: dict[str, Any]) -> Any:
        body = {"messages": USER, "max_tokens": 5, "tools": [WEATHER], "tool_choice": choice}
        return to_chat_request(MessagesRequest.model_validate(body))

    single = chat({"type": "any", "disable_parallel_tool_use": True})
    assert single.tool_choice == "required"
    assert single.parallel_tool_calls is False
    named = chat({"type": "tool", "name": "get_weather"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert named.parallel_tool_calls is None
    assert chat({"type": "auto"}).tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Current weather of a city",
            },
        }
    ]


def test_server_tools_and_unknown_fields_are_ignored(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    history = [
        {"role": "user", "content": "Search the weather"},
        {
            "role": "assistant",
            "content": [
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                {"type": "text", "text": "Found it."},
            ],
        },
        {"role": "user", "content": "Thanks"},
    ]
    message = create(
        app,
        messages=history,
        tools=[WEATHER, WEB_SEARCH],
        metadata={"user_id": "u-1"},
        service_tier="auto",
        extra_body={"container": "c-1", "unknown_field": {"x": 1}},
    )
    assert message.content[0].text == "Hello there!"
    prompt = prompt_of(hf_tokenizer, engine)
    assert '"get_weather"' in prompt and "web_search" not in prompt
    assert "Found it." in prompt and "srvtoolu" not in prompt


def test_count_tokens_matches_create(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    kwargs: dict[str, Any] = {
        "messages": USER,
        "system": [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}],
        "tools": [WEATHER],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }

    async def call(client: AsyncAnthropic) -> tuple[Any, Any]:
        counted = await client.messages.count_tokens(model="m", **kwargs)
        created = await client.messages.create(model="m", max_tokens=8, **kwargs)
        return counted, created

    counted, created = run(app, call)
    assert counted.input_tokens == len(engine.requests[0].prompt_tokens) > 0
    assert counted.input_tokens == created.usage.input_tokens
    assert "Be terse.\n\nBe kind." in prompt_of(hf_tokenizer, engine)
    # The alias answers the same.
    response = post(app, "/messages/count_tokens", {"model": "m", **kwargs})
    assert response.status_code == 200 and response.json() == {"input_tokens": counted.input_tokens}


def test_alias_route_and_version_header(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO)
    body = {"model": "m", "max_tokens": 5, "messages": USER}
    plain = post(app, "/messages", body)
    versioned = post(app, "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    for response in (plain, versioned):
        assert response.status_code == 200, response.text
        assert response.json()["content"] == [{"type": "text", "text": "Hello there!"}]


def test_conversion_of_blocks() -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "top_k": 5,
        "top_p": 0.5,
        "seed": 7,
        "min_p": 0.1,
        "metadata": {"user_id": "x"},
        "messages": [
            {"role": "user", "content": "one"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "two"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                    },
                    {"type": "document", "source": {"type": "text", "data": "doc text"}},
                ],
            },
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_q", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_q",
                        "content": [
                            {"type": "text", "text": "see"},
                            {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}},
                        ],
                    }
                ],
            },
        ],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    }
    chat = to_chat_request(MessagesRequest.model_validate(body))
    messages = [turn.message for turn in chat.turns]
    assert messages[0] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "one"},  # consecutive user turns are merged
            {"type": "text", "text": "two"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "doc text"},
        ],
    }
    assert messages[1]["tool_calls"][0] == {
        "id": "q",
        "type": "function",
        "function": {"name": "f", "arguments": "{}"},
    }
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "q",
        "content": [
            {"type": "text", "text": "see"},
            {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
        ],
    }
    assert len(messages) == 3
    options = chat.options
    assert chat.max_tokens == 9
    assert (options.top_k, options.top_p, options.seed, options.min_p) == (5, 0.5, 7, 0.1)
    assert "metadata" not in (options.model_extra or {})
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }
    counted = to_chat_request(CountTokensRequest.model_validate({**body, "stop_sequences": ["x"]}))
    assert counted.max_tokens is None and counted.options.stop is None


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": USER}, "max_tokens"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 5, "messages": "Hi"}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
        (
            {"max_tokens": 5, "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "x"}},
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": USER, "thinking": {"type": "sometimes"}}, "thinking"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0]",
        ),
        ({"max_tokens": 5, "messages": USER, "tools": [{"name": "f"}]}, "input_schema"),
    ],
)
def test_invalid_requests_are_anthropic_400(hf_tokenizer: Any, body: Any, fragment: str) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    response = post(app, "/v1/messages", {"model": "m", **body})
    assert fragment in anthropic_error(response, 400, "invalid_request_error")
    assert engine.requests == []


BLOCKS_THAT_ARE_NO_OBJECTS = [
    [{"type": "tool_result", "tool_use_id": "t1", "content": [None]}],
    [{"type": "tool_result", "tool_use_id": "t1", "content": [1, "a"]}],
    [{"type": "document", "source": {"type": "content", "content": [1]}}],
]


@pytest.mark.parametrize("content", BLOCKS_THAT_ARE_NO_OBJECTS)
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_nested_blocks_that_are_no_objects_are_400(
    hf_tokenizer: Any, path: str, content: list[Any]
) -> None:
    """A tool result's or a document's inner block that is no object was read as one: 500
    AttributeError from count_tokens."""
    app, engine = make_app(hf_tokenizer, HELLO)
    messages = [{"role": "user", "content": content}]
    response = post(app, path, {"model": "m", "max_tokens": 5, "messages": messages})
    assert "messages[0].content[0]" in anthropic_error(response, 400, "invalid_request_error")
    assert engine.requests == []


def test_malformed_json_is_anthropic_400(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO)
    response = post(app, "/v1/messages/count_tokens", b"{not json")
    assert "JSON" in anthropic_error(response, 400, "invalid_request_error")


def test_sdk_sees_undeclared_tool_choice_as_bad_request(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO)
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(app, messages=USER, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
    assert "nope" in body["error"]["message"]


def test_image_on_a_text_model_is_a_clear_400(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, HELLO)
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    for content, where in (
        ([{"type": "text", "text": "What is this?"}, image], "messages[2].content[1]"),
        (
            [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}],
            "messages[2].content[0].content[0]",
        ),
    ):
        # The block is named as the client sent it: Anthropic's `image` block, at its place
        # in the request (not the chat path's `image_url` part at its chat message index).
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes?"}]
        messages.append({"role": "user", "content": content})
        with pytest.raises(anthropic.BadRequestError) as caught:
            create(app, system="Be brief.", messages=messages)
        body = caught.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
        assert message.startswith(f"{where}: image input is not supported"), message
        assert "'image' content block" in message and "image_url" not in message
        counted = post(app, "/v1/messages/count_tokens", {"model": "m", "messages": messages})
        assert counted.status_code == 400 and counted.json()["error"]["message"] == message
    assert engine.requests == []


def test_auth_with_x_api_key(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO, api_key=["secret"])
    assert create_with_key(app, "secret").content[0].text == "Hello there!"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        create_with_key(app, "wrong")
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"] == {"type": "authentication_error", "message": "Invalid API Key"}
    response = post(app, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER})
    assert anthropic_error(response, 401, "authentication_error") == "Missing API key"
    # Other routes keep the OpenAI shape.
    chat = post(app, "/v1/chat/completions", {"messages": USER})
    assert chat.status_code == 401
    assert chat.json()["error"]["type"] == "missing_api_key" and "type" not in chat.json()


def create_with_key(app: Any, key: str) -> Any:
    async def call(client: AsyncAnthropic) -> Any:
        return await client.messages.create(model="m", max_tokens=5, messages=USER)  # type: ignore[arg-type]

    return run(app, call, api_key=key)


def test_loading_is_anthropic_503(hf_tokenizer: Any) -> None:
    app = create_app(make_state(hf_tokenizer, None))  # no engine yet: still loading
    response = post(app, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER})
    anthropic_error(response, 503, "overloaded_error")
    assert response.headers["retry-after"] == "1"


def test_api_prefix_and_wrong_method(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, HELLO, api_prefix="api")

    async def call(client: AsyncAnthropic) -> Any:
        return await client.messages.create(model="m", max_tokens=5, messages=USER)  # type: ignore[arg-type]

    assert run(app, call, prefix="/api").content[0].text == "Hello there!"
    response = post(app, "/api/v1/messages", {"model": "m", "messages": USER})
    assert "max_tokens" in anthropic_error(response, 400, "invalid_request_error")

    async def get() -> Any:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.get("/api/v1/messages")

    anthropic_error(asyncio.run(get()), 405, "invalid_request_error")
    unprefixed = post(app, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": USER})
    assert unprefixed.status_code == 404 and "error" in unprefixed.json()
    assert "type" not in unprefixed.json()  # not a Messages route here: OpenAI shape


def test_messages_path_matching() -> None:
    assert is_messages_path("/v1/messages") and is_messages_path("/messages/count_tokens")
    assert is_messages_path("/v1/messages/")
    assert not is_messages_path("/v1/messagesx") and not is_messages_path("/v1/chat/completions")
    assert is_messages_path("/api/v1/messages", "/api")
    assert not is_messages_path("/v1/messages", "/api")
    assert not is_messages_path("/apiv1/messages", "/api")


# -------------------------------------------------------------- a real `mlxcel serve`


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "4096", "--api-key", API_KEY]
    args += ["--chat-template-kwargs", json.dumps(THINKING_OPT_IN)]
    with ServeProcess([*args, "--chat-template-file", str(template)]) as server:
        yield server.url


def prompt_total(usage: Any) -> int:
    """The prompt tokens of an Anthropic `usage`: input, cache reads and cache writes."""
    parts = (usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    return int(usage.input_tokens) + sum(p or 0 for p in parts)


def test_real_server_create_stream_and_count(served: str) -> None:
    client = Anthropic(base_url=served, api_key=API_KEY, max_retries=0)
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": 3,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Hello"}],
        "extra_body": {"temperature": 0, "ignore_eos": True},
    }
    message = client.messages.create(**kwargs)
    assert message.model == "tiny" and message.stop_reason == "max_tokens"
    (block,) = message.content
    assert isinstance(block, anthropic.types.TextBlock) and message.usage.output_tokens == 3
    with client.messages.stream(**kwargs) as s:
        events = list(s)
        final = s.get_final_message()
    text = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    (streamed,) = final.content
    assert isinstance(streamed, anthropic.types.TextBlock)
    assert text == block.text == streamed.text  # greedy: the same text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    counted = client.messages.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    # Anthropic's split: input_tokens leaves out the cache reads; the parts add up to the
    # prompt count_tokens counts. The streamed run repeats the prompt: a cache hit, which
    # message_start already reports (not 0 there and the real number later).
    assert prompt_total(message.usage) == prompt_total(final.usage) == counted.input_tokens
    start = events[0]
    assert start.type == "message_start"
    assert start.message.usage.model_dump() == {**final.usage.model_dump(), "output_tokens": 0}
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens == counted.input_tokens - final.usage.cache_read_input_tokens
    wrong = Anthropic(base_url=served, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(**kwargs)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_real_server_forced_tool_use(served: str) -> None:
    client = Anthropic(base_url=served, api_key=API_KEY, max_retries=0)
    message = client.messages.create(  # type: ignore[call-overload]
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "What time is it in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time"},
        extra_body={"temperature": 1.0, "seed": 3},
    )
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_time" and calls[0].id.startswith("toolu_")
    zone = calls[0].input["zone"]
    assert isinstance(zone, int) and -12 <= zone <= 14
    assert set(calls[0].input) == {"zone"}
    # Streamed: the input_json_delta fragments reassemble to the final input.
    with client.messages.stream(
        model="tiny",
        max_tokens=300,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 1.0, "seed": 5},
    ) as s:
        fragments = [
            event.delta.partial_json
            for event in s
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta"
        ]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use", final
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_weather" and json.loads("".join(fragments)) == call.input
    assert isinstance(call.input["city"], str)


def test_real_server_context_overflow_reads_as_anthropic(served: str) -> None:
    """A prompt past the context: Anthropic's 400 "prompt is too long: N tokens > M
    maximum", the text the SDKs' users (langchain-anthropic, litellm) match, streamed or not."""
    client = Anthropic(base_url=served, api_key=API_KEY, max_retries=0)
    messages: Any = [{"role": "user", "content": "hello world " * 3000}]
    counted = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
    for stream in (False, True):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="tiny", max_tokens=5, messages=messages, stream=stream)
        body = caught.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        match = re.fullmatch(
            r"prompt is too long: (\d+) tokens > (\d+) maximum", body["error"]["message"]
        )
        assert match is not None, body
        assert int(match[1]) == counted > int(match[2]) > 0
