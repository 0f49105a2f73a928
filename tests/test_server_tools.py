"""Tool calls and reasoning on /v1/chat/completions, end to end through the `openai` SDK.

A stand-in engine answers with a scripted token sequence (one event per token, as the
scheduler sends them) behind the real HTTP stack, so the parsing is checked exactly; the
tokenizer is the tiny llama fixture's, given a Hermes/Qwen-style template written for
these tests (`<tool_call>` JSON and `<think>` reasoning).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
from fixtures.stand_in_engine import StandInEngine
from openai import AsyncOpenAI

from mlxcel.config import Settings
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, TokenLogprob
from mlxcel.server.app import create_app
from mlxcel.server.bridge import EngineClient
from mlxcel.server.state import ServerState

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{- message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% endif %}"""

THINKING_OPT_IN = {"enable_thinking": False}
"""The server default these tests run QWEN_STYLE_TEMPLATE with: thinking only when a request
asks for it (under `--reasoning auto` a template with an `enable_thinking` switch would
otherwise render thinking on, as llama-server does)."""


def opt_in_thinking(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with THINKING_OPT_IN as the template default unless they set reasoning."""
    if "reasoning" in settings or "chat_template_kwargs" in settings:
        return settings
    return {"chat_template_kwargs": dict(THINKING_OPT_IN), **settings}


PLAIN_TEMPLATE = """\
{%- for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}assistant:"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "Weather in Paris?"}]

CALL_TOKENS = [
    "I",
    " will",
    " check",
    ".",
    "\n",
    "<tool",
    "_call",
    ">\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": ',
    '"Paris"}}',
    "\n</tool_call>",
]
CALL_ARGUMENTS = '{"city": "Paris"}'
THINK_TOKENS = ["Let", " me", " think", ".", "</th", "ink>", "\n\n", "Hi", "!"]
ONLY_THINKING = ["Still", " pondering", " this"]


class ScriptedEngine(StandInEngine):
    """Stands in for TextEngine: every request gets `tokens`, one event per token."""

    context_per_slot = 1024

    def __init__(self, tokens: Sequence[str]) -> None:
        self.tokens = list(tokens)
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        self.requests.append(request)
        for i, text in enumerate(self.tokens):
            logprobs = (
                (TokenLogprob(token_id=10 + i, logprob=-0.25, top=((10 + i, -0.25),)),)
                if request.logprobs is not None
                else ()
            )
            sink(
                GenerationEvent(
                    request.request_id, text=text, token_ids=(10 + i,), logprobs=logprobs
                )
            )
        sink(
            GenerationEvent(
                request.request_id,
                finish_reason="stop",
                prompt_tokens=len(request.prompt_tokens),
                completion_tokens=len(self.tokens),
            )
        )


def make_app(
    hf_tokenizer: Any,
    tokens: Sequence[str],
    *,
    template: str = QWEN_STYLE_TEMPLATE,
    **settings: Any,
) -> tuple[Any, ScriptedEngine]:
    from mlxcel.engine.tokenizer import Tokenizer

    engine = ScriptedEngine(tokens)
    if template == QWEN_STYLE_TEMPLATE:
        settings = opt_in_thinking(settings)
    state = ServerState(
        settings=Settings(warmup=False, **settings),
        tokenizer=Tokenizer(hf_tokenizer, chat_template=template),
    )
    state.client = EngineClient(engine)
    return create_app(state), engine


def run(app: Any, call: Any) -> Any:
    """`await call(client)` with an SDK client bound to `app` (no socket)."""

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t/v1") as http:
            client = AsyncOpenAI(
                api_key="x",
                base_url="http://t/v1",
                http_client=http,  # type: ignore[arg-type]
            )
            return await call(client)

    return asyncio.run(go())


def stream_chunks(app: Any, **kwargs: Any) -> list[Any]:
    async def call(client: AsyncOpenAI) -> list[Any]:
        stream = await client.chat.completions.create(model="m", stream=True, **kwargs)
        return [chunk async for chunk in stream]

    return list(run(app, call))


def create(app: Any, **kwargs: Any) -> Any:
    async def call(client: AsyncOpenAI) -> Any:
        return await client.chat.completions.create(model="m", **kwargs)

    return run(app, call)


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {}).get(key)


def test_non_streaming_tool_call(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, CALL_TOKENS)
    answer = create(app, messages=USER, tools=[WEATHER_TOOL])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert call.function.arguments == CALL_ARGUMENTS
    assert call.id
    assert choice.message.content == "I will check."
    assert "<tool_call>" not in (choice.message.content or "")
    assert engine.requests[0].skip_special is False  # markers must reach the parser


def test_streaming_tool_call_assembles(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, CALL_TOKENS)
    chunks = stream_chunks(app, messages=USER, tools=[WEATHER_TOOL])
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        delta = chunk.choices[0].delta
        assert "<tool" not in (delta.content or "") and "}" not in (delta.content or "")
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
    assert content == "I will check."
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert calls[0]["arguments"] == CALL_ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_markup_as_content(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, CALL_TOKENS)
    answer = create(app, messages=USER, tools=[WEATHER_TOOL], tool_choice="none")
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is None
    assert "<tool_call>" in (choice.message.content or "")


def test_reasoning_split_non_streaming_and_streaming(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, THINK_TOKENS)
    kwargs: dict[str, Any] = {
        "messages": USER,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    }
    message = create(app, **kwargs).choices[0].message
    assert extra(message, "reasoning_content") == "Let me think."
    assert message.content == "Hi!"
    assert extra(message, "reasoning_only") is None

    chunks = stream_chunks(app, **kwargs)
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(extra(d, "reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == "Let me think." and content == "Hi!"
    assert "think>" not in reasoning + content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert extra(deltas[-1], "reasoning_only") is None


def test_reasoning_only(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, ONLY_THINKING)
    kwargs: dict[str, Any] = {
        "messages": USER,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    }
    message = create(app, **kwargs).choices[0].message
    assert extra(message, "reasoning_content") == "Still pondering this"
    assert not message.content
    assert extra(message, "reasoning_only") is True

    chunks = stream_chunks(app, **kwargs)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop"
    assert extra(last.delta, "reasoning_only") is True
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_reasoning_format_none_keeps_think_text(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["<think>", "x", "</think>", "y"], reasoning_format="none")
    message = create(app, messages=USER).choices[0].message
    assert message.content == "<think>x</think>y"
    assert extra(message, "reasoning_content") is None
    assert engine.requests[0].skip_special is True  # nothing to parse: specials skipped


def test_streaming_logprobs_keep_one_position_per_token(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, CALL_TOKENS)
    chunks = stream_chunks(app, messages=USER, tools=[WEATHER_TOOL], logprobs=True, top_logprobs=1)
    with_logprobs = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert len(with_logprobs) == len(CALL_TOKENS)
    assert [len(c.choices[0].logprobs.content) for c in with_logprobs] == [1] * len(CALL_TOKENS)
    placeholders = [c for c in with_logprobs if c.choices[0].delta.content == ""]
    assert placeholders  # the suppressed markup still holds its positions
    values = [c.choices[0].logprobs.content[0].logprob for c in with_logprobs]
    assert values == [-0.25] * len(CALL_TOKENS)
    # the call still assembles and nothing leaks
    assert not any("<tool" in (c.choices[0].delta.content or "") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_earlier_think_blocks_are_stripped_unless_preserved(hf_tokenizer: Any) -> None:
    history = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>secret plan</think>answer"},
        {"role": "user", "content": "second"},
    ]
    app, engine = make_app(hf_tokenizer, ["ok"])
    create(app, messages=history)
    create(app, messages=history, extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    decoded = [hf_tokenizer.decode(r.prompt_tokens) for r in engine.requests]
    assert "secret plan" not in decoded[0] and "answer" in decoded[0]
    assert "secret plan" in decoded[1]


def test_health_reports_the_tool_call_parser(hf_tokenizer: Any) -> None:
    async def health(app: Any) -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.get("/health")).json()

    tools_app, _ = make_app(hf_tokenizer, [])
    plain_app, _ = make_app(hf_tokenizer, [], template=PLAIN_TEMPLATE)
    assert asyncio.run(health(tools_app))["tool_call_parser"] == "mlxcel"
    assert asyncio.run(health(plain_app))["tool_call_parser"] is None
