"""A tool call cut off by max_tokens is reported as generated, never with invented arguments.

OpenAI's behaviour: finish_reason "length" and the call's arguments text cut where
generation stopped ("" when none was generated). End to end on the tiny random-weight
qwen3 model with a Qwen-style template and a forced (grammar-constrained) call, greedy, so
each cut-off answer is a prefix of the full one: chat (streamed and not), /v1/responses
(an "incomplete" function_call) and /v1/messages (stop_reason "max_tokens", the tool_use
block's input holding the members generated whole).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import AUTH, ServeProcess
from sse_reader import sse_json
from test_server_tools import QWEN_STYLE_TEMPLATE, THINKING_OPT_IN

from mlxcel.engine.chat.tool_calls import get_format
from mlxcel.engine.chat.tool_calls.base import collect
from mlxcel.engine.chat.tool_calls.jsonscan import complete_members
from mlxcel.server.anthropic_messages.encoder import tool_input

TIME = {
    "type": "object",
    "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14},
        "unit": {"type": "string", "enum": ["utc", "local"]},
    },
    "required": ["zone", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
USER = [{"role": "user", "content": "What time is it?"}]
KIMI = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"

# ------------------------------------------------------------------------ parsers


@pytest.mark.parametrize(
    ("fmt", "text", "arguments"),
    [
        ("hermes", '<tool_call>\n{"name": "get_time", "argu', ""),
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": ', ""),
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1', '{"zone": 1'),
        ("mistral_nemo", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zo', '{"zo'),
        ("mistral_nemo", "[TOOL_CALLS]get_time[ARGS]", ""),
        ("llama3", '<|python_tag|>{"name": "get_time", ', ""),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n", ""),
        (  # the parameters generated whole, not closed; the one cut off is left out
            "qwen3_coder",
            "<tool_call>\n<function=get_time>\n<parameter=zone>\n3\n</parameter>\n"
            "<parameter=unit>\nut",
            '{"zone": 3',
        ),
        ("functionary_v31", "<function=get_time>", ""),
        ("functionary_v31", '<function=get_time>{"zone": 3', '{"zone": 3'),
        ("kimi_k2", f"{KIMI}<|tool_call_argument_begin|>", ""),
        ("kimi_k2", f'{KIMI}<|tool_call_argument_begin|>{{"zone": 3', '{"zone": 3'),
    ],
)
def test_a_cut_off_call_keeps_the_arguments_generated(fmt: str, text: str, arguments: str) -> None:
    tool_format = get_format(fmt)
    parsed = tool_format.parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_time", arguments)]
    stream = tool_format.stream_filter(TOOLS)  # one character at a time: the same answer
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    assert [(c.name, c.arguments) for c in collect(deltas).calls] == [("get_time", arguments)]


@pytest.mark.parametrize(
    ("fmt", "text", "arguments"),
    [
        ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "{}"),
        ("kimi_k2", f"{KIMI}<|tool_call_argument_begin|><|tool_call_end|>", "{}"),
        ("functionary_v31", "<function=get_time></function>", "{}"),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "{}"),
        (
            "qwen3_coder",
            "<function=get_time>\n<parameter=zone>\n3\n</parameter>\n</function>",
            '{"zone": 3}',
        ),
    ],
)
def test_a_complete_call_is_unchanged(fmt: str, text: str, arguments: str) -> None:
    parsed = get_format(fmt).parse(text, TOOLS)
    assert [c.arguments for c in parsed.calls] == [arguments]


def test_anthropic_input_of_cut_off_arguments_is_what_was_generated_whole() -> None:
    assert complete_members('{"zone": 3, "unit": "ut') == {"zone": 3}
    assert complete_members('{"zone": 3') == {}  # the number may still have been growing
    assert complete_members('{"a": {"b": [1, 2]}, "c"') == {"a": {"b": [1, 2]}}
    assert complete_members("[1, 2") is None
    assert tool_input('{"zone": 3, "unit": "ut') == {"zone": 3}
    assert tool_input("") == {}
    assert tool_input('{"zone": 3}') == {"zone": 3}


# --------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def http(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = ["-m", str(tiny_qwen3_dir), "-np", "1", "-c", "4096", "--api-key", "sk-test-key"]
    args += ["--chat-template-file", str(template)]
    args += ["--chat-template-kwargs", json.dumps(THINKING_OPT_IN)]
    with ServeProcess(args) as server, server.client(headers=AUTH) as client:
        yield client


def _chat(http: httpx.Client, max_tokens: int, **extra: Any) -> Any:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    out = http.post("/v1/chat/completions", json={**body, "max_tokens": max_tokens, **extra})
    assert out.status_code == 200, out.text
    return out


def _streamed_call(http: httpx.Client, max_tokens: int) -> tuple[str | None, list[str], str]:
    """(finish_reason, call names, concatenated arguments) of a streamed answer."""
    names: list[str] = []
    arguments: list[str] = []
    finish = None
    for chunk in sse_json(_chat(http, max_tokens, stream=True).text):
        for choice in chunk.get("choices", []):
            finish = choice.get("finish_reason") or finish
            for part in choice["delta"].get("tool_calls") or []:
                if part["function"].get("name"):
                    names.append(part["function"]["name"])
                arguments.append(part["function"].get("arguments") or "")
    return finish, names, "".join(arguments)


def test_cut_off_calls_report_their_arguments_as_generated(http: httpx.Client) -> None:
    full = _chat(http, 400).json()
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    complete = choice["message"]["tool_calls"][0]["function"]["arguments"]
    used = full["usage"]["completion_tokens"]
    cuts = list(range(12, used, 2))
    named = 0
    for n in cuts:
        answer = _chat(http, n).json()["choices"][0]
        assert answer["finish_reason"] == "length", (n, answer)
        calls = answer["message"].get("tool_calls") or []
        if not calls:  # cut before the name was complete: nothing to call yet
            continue
        named += 1
        arguments = calls[0]["function"]["arguments"]
        assert calls[0]["function"]["name"] == "get_time"
        assert complete.startswith(arguments), (n, arguments, complete)
        assert arguments != "{}", n
        finish, names, streamed = _streamed_call(http, n)
        assert (finish, names, streamed) == ("length", ["get_time"], arguments), n
    assert named >= 3, (cuts, complete)


def test_cut_off_call_on_responses_and_messages(http: httpx.Client) -> None:
    full = _chat(http, 400).json()
    complete = json.loads(full["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    used = full["usage"]["completion_tokens"]
    function = TOOLS[0]["function"]
    responses = {"type": "function", "name": "get_time", "parameters": function["parameters"]}
    out = http.post(
        "/v1/responses",
        json={
            "input": USER,
            "tools": [responses],
            "tool_choice": "required",
            "temperature": 0,
            "max_output_tokens": used - 2,
        },
    ).json()
    assert (
        out["status"] == "incomplete" and out["incomplete_details"]["reason"] == "max_output_tokens"
    )
    (item,) = [i for i in out["output"] if i["type"] == "function_call"]
    assert item["status"] == "incomplete" and item["name"] == "get_time"
    assert item["arguments"] != "{}" and complete_members(item["arguments"]) is not None
    anthropic = {"name": "get_time", "input_schema": function["parameters"]}
    out = http.post(
        "/v1/messages",
        json={
            "messages": USER,
            "tools": [anthropic],
            "tool_choice": {"type": "any"},
            "temperature": 0,
            "max_tokens": used - 2,
        },
    ).json()
    assert out["stop_reason"] == "max_tokens", out
    (block,) = [b for b in out["content"] if b["type"] == "tool_use"]
    assert block["name"] == "get_time"
    assert block["input"] and block["input"].items() <= complete.items(), (block, complete)
