"""Chat templates in the Jinja sandbox, and message normalization."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from typing import Any, cast

import pytest

from mlxcel.engine.chat.messages import normalize_messages, remove_think, strip_think_blocks
from mlxcel.engine.chat.template import (
    CHATML_TEMPLATE,
    RESERVED_VARIABLES,
    ChatTemplate,
    TemplateError,
    detect_family,
)

# A ChatML template with Hermes-style tools, in the shape models ship.
CHATML_TOOLS = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- 'Tools:\\n' }}
{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}
{{- 'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- if message.role == 'system' %}
    {%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
  {%- elif message.role == 'assistant' and message.tool_calls is defined %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if message.content %}{{- message.content + '\\n' }}{%- endif %}
    {%- for call in message.tool_calls %}
      {{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
      {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
    {{- '\\n</tool_response><|im_end|>\\n' }}
  {%- else %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# A Llama-3-style template: headers, bos_token, date via strftime_now, JSON tool calls.
LLAMA3_STYLE = """
{{- bos_token }}
{%- if date_string is not defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
  {%- set system = messages[0]['content'] | trim %}
  {%- set messages = messages[1:] %}
{%- else %}
  {%- set system = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is defined %}
  {{- 'You may call these functions:\\n' }}
  {%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
  {%- if message.tool_calls is defined %}
    {%- if message.tool_calls | length != 1 %}
      {{- raise_exception('Only one tool call per turn is supported.') }}
    {%- endif %}
    {%- set call = message.tool_calls[0].function %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
  {%- elif message.role == 'tool' %}
    {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
  {%- else %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
    {{- message.content | trim + '<|eot_id|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _chat(source: str, **kwargs: Any) -> ChatTemplate:
    return ChatTemplate(source, bos_token=kwargs.pop("bos", "<s>"), eos_token="</s>", **kwargs)


def test_chatml_template_renders_a_conversation() -> None:
    messages = normalize_messages(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]
    )
    out = _chat(CHATML_TOOLS).render(messages)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = _chat(CHATML_TOOLS).render(messages, add_generation_prompt=False)
    assert no_prompt == out.removesuffix("<|im_start|>assistant\n")


def test_chatml_template_with_tools_and_tool_calls() -> None:
    messages = normalize_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
        ]
    )
    out = _chat(CHATML_TOOLS).render(messages, tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\nTools:\n" + json.dumps(WEATHER_TOOL) + "\n")
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    )
    assert "<tool_response>\n18°C, sunny\n</tool_response>" in out
    assert out.endswith("<|im_start|>assistant\n")


def test_llama3_style_template() -> None:
    messages = normalize_messages(
        [
            {"role": "system", "content": "  You are helpful.  "},
            {"role": "user", "content": "What's 2+2?"},
        ]
    )
    template = _chat(LLAMA3_STYLE, bos="<|begin_of_text|>")
    out = template.render(messages, date_string="26 Jul 2024")
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Today Date: 26 Jul 2024\n\nYou are helpful.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat's 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # Without date_string the template asks strftime_now for today's date.
    today = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {today}" in template.render(messages)
    assert template.family == "llama3"


def test_llama3_style_tools_and_raise_exception() -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = normalize_messages(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "content": "cold"},
        ]
    )
    out = _chat(LLAMA3_STYLE).render(messages, tools=[WEATHER_TOOL], date_string="x")
    assert json.dumps(WEATHER_TOOL, indent=4) in out
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in out
    assert "<|start_header_id|>ipython<|end_header_id|>\n\ncold<|eot_id|>" in out

    two_calls: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [call, call]},
    ]
    with pytest.raises(TemplateError) as info:
        _chat(LLAMA3_STYLE).render(normalize_messages(two_calls))
    assert str(info.value) == "Only one tool call per turn is supported."


def test_matches_transformers_rendering() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = normalize_messages(
        [
            {"role": "system", "content": "Sys"},
            {"role": "user", "content": "Wetter in München?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": '{"city": "München"}'}}
                ],
            },
            {"role": "tool", "content": "12°C"},
        ]
    )
    for source in (CHATML_TOOLS, LLAMA3_STYLE):
        ours = _chat(source).render(messages, tools=[WEATHER_TOOL], date_string="1 Jan 2025")
        result: Any = render_jinja_template(
            conversations=[messages],
            tools=[WEATHER_TOOL],
            chat_template=source,
            add_generation_prompt=True,
            bos_token="<s>",
            eos_token="</s>",
            date_string="1 Jan 2025",
        )
        assert ours == result[0][0]


def test_tools_undefined_unless_given() -> None:
    template = _chat("{{ tools is defined }}|{{ documents is defined }}")
    assert template.render([]) == "False|False"
    assert template.render([], tools=None) == "False|False"
    assert template.render([], tools=[]) == "False|False"
    assert template.render([], tools=[WEATHER_TOOL], documents=[{"text": "d"}]) == "True|True"


def test_special_token_variables() -> None:
    source = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}"
    template = ChatTemplate(
        source, bos_token="<s>", eos_token="</s>", extra_special={"pad_token": "<pad>"}
    )
    assert template.render([]) == "<s>|</s>|<pad>|True"
    assert ChatTemplate(source, bos_token=None, eos_token=None).render([]) == "|||False"


@pytest.mark.parametrize("key", sorted(RESERVED_VARIABLES) + ["pad_token"])
def test_reserved_kwargs_are_refused(key: str) -> None:
    template = ChatTemplate(
        "x", bos_token="<s>", eos_token="</s>", extra_special={"pad_token": "<p>"}
    )
    expected = f"chat_template_kwargs may not set {key!r}"
    with pytest.raises(TemplateError) as info:
        template.render([], template_kwargs={key: "override"})
    assert str(info.value) == expected
    with pytest.raises(TemplateError, match=expected):
        template.check_kwargs({"fine": 1, key: "override"})
    template.check_kwargs({"enable_thinking": True})


def test_reserved_names_spread_as_kwargs_are_refused() -> None:
    template = ChatTemplate("x", bos_token=None, eos_token=None, extra_special={"unk_token": "?"})
    for key in ("messages", "bos_token", "eos_token", "unk_token"):
        with pytest.raises(TemplateError, match=f"may not set '{key}'"):
            template.render([], **cast(dict[str, Any], {key: "override"}))


def test_unknown_kwargs_reach_the_template() -> None:
    source = "{{ enable_thinking }}/{{ preserve_thinking }}/{{ custom_kw | tojson }}"
    out = _chat(source).render(
        [], enable_thinking=False, preserve_thinking=True, custom_kw=[1, "é"]
    )
    assert out == 'False/True/[1, "é"]'
    request = {"enable_thinking": True, "preserve_thinking": False, "custom_kw": {}}
    assert _chat(source).render([], template_kwargs=request) == "True/False/{}"


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ ''['__class__'] }}",
        "{{ ''|attr('__class__') }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'].system('id') }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ strftime_now.__code__ }}",
        "{{ self.__init__.__globals__ }}",
        "{{ not_defined.__class__.__base__.__subclasses__() }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ '{0.__class__.__mro__}'.format('') }}",
        "{{ messages.append('x') }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ messages.pop() }}",
        "{% set m = messages[0] %}{% set m.role = 'system' %}",
        "{{ 'x' * 100000000 }}",
        "{{ 9 ** 99999999 }}",
        "{{ range(100000000) | list }}",
    ],
)
def test_sandbox_escapes_fail(payload: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    template = _chat(payload)
    with pytest.raises(TemplateError) as info:
        template.render(messages)
    assert "\n" not in str(info.value)
    assert messages == [{"role": "user", "content": "hi"}]  # nothing was mutated


def test_rendering_errors_become_one_line_template_errors() -> None:
    with pytest.raises(TemplateError, match=r"does not compile \(line 2\)"):
        _chat("ok\n{% for x in %}")
    with pytest.raises(TemplateError, match="No filter named 'nope'"):
        _chat("{{ messages | nope }}")
    with pytest.raises(TemplateError, match="No filter named 'nope'"):
        _chat("{% if add_generation_prompt %}{{ x | nope }}{% endif %}").render([])
    with pytest.raises(TemplateError, match="ZeroDivisionError"):
        _chat("{{ 1 // 0 }}").render([])
    with pytest.raises(TemplateError) as info:
        _chat("{{ raise_exception('line one\nline two') }}").render([])
    assert str(info.value) == "line one line two"
    assert isinstance(info.value, ValueError)


def test_tojson_matches_json_dumps() -> None:
    value = {"b": "ü → 日本", "a": [1, 2.5, None, True], "html": "<tag>&'"}
    template = _chat(
        "{{ v | tojson }}\n{{ v | tojson(indent=2) }}\n{{ v | tojson(sort_keys=true) }}\n"
        "{{ v | tojson(separators=(',', ':')) }}"
    )
    lines = template.render([], v=value).split("\n", 1)
    assert lines[0] == json.dumps(value, ensure_ascii=False)
    rest = lines[1]
    assert rest.startswith(json.dumps(value, ensure_ascii=False, indent=2))
    assert json.dumps(value, ensure_ascii=False, sort_keys=True) in rest
    assert rest.endswith(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def test_strftime_now_and_extensions() -> None:
    out = _chat("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert out == datetime.now().strftime("%Y-%m-%d")
    loops = "{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
    loops += "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert _chat(loops).render([]) == "023"
    generation = "{% generation %}A{{ 1 + 1 }}{% endgeneration %}B"
    assert _chat(generation).render([]) == "A2B"
    # trim_blocks / lstrip_blocks
    assert _chat("  {% if true %}\nX\n  {% endif %}\nY").render([]) == "X\nY"


def test_chatml_fallback() -> None:
    messages = normalize_messages(
        [
            {"role": "developer", "content": "Rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    out = ChatTemplate(CHATML_TEMPLATE, bos_token=None, eos_token=None).render(messages)
    assert out == (
        "<|im_start|>system\nRules<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )


def test_detect_family() -> None:
    assert detect_family(CHATML_TEMPLATE) == "chatml"
    assert detect_family(CHATML_TOOLS) == "hermes"
    assert detect_family(LLAMA3_STYLE) == "llama3"
    assert detect_family("<|im_start|>{{ x }}<think></think>") == "qwen3"
    assert detect_family("<tool_call><function=f><parameter=p><|im_start|>") == "qwen3_coder"
    assert detect_family("[INST] {{ m }} [/INST]") == "mistral"
    assert detect_family("<start_of_turn>user") == "gemma"
    assert detect_family("<|start|>assistant<|channel|>final<|message|>") == "harmony"
    assert detect_family("{{ messages }}") == "generic"


def test_chat_package_exports_lazily() -> None:
    import mlxcel.engine.chat as chat

    assert chat.ChatTemplate is ChatTemplate
    assert chat.strip_think_blocks is strip_think_blocks
    code = "import sys, mlxcel.engine.chat; print('jinja2' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


# --- normalize_messages ----------------------------------------------------------------


def test_normalize_text_parts_and_roles() -> None:
    out = normalize_messages(
        [
            {"role": "developer", "content": "dev"},
            {"role": "user", "content": [{"type": "text", "text": "x"}, "y"], "name": "ann"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert out == [
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "x\ny", "name": "ann"},
        {"role": "assistant", "content": "no"},
        {"role": "assistant", "content": ""},
    ]
    joined = normalize_messages([{"role": "user", "content": ["a", "b"]}], part_separator="")
    assert joined[0]["content"] == "ab"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "wizard", "content": "x"}],
        [{"content": "x"}],
        ["not a message"],
        [],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "mystery"}]}],
        [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}],
        [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
        [{"role": "tool", "content": "x", "tool_call_id": 7}],
    ],
)
def test_normalize_rejects_bad_messages(messages: list[Any]) -> None:
    with pytest.raises(ValueError):
        normalize_messages(messages)


def test_invalid_role_message() -> None:
    with pytest.raises(ValueError, match="message 1 has invalid role 'function'"):
        normalize_messages([{"role": "user", "content": "a"}, {"role": "function", "content": "b"}])


def test_media_parts_need_permission() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]
    with pytest.raises(ValueError, match="does not accept image input"):
        normalize_messages(messages)
    audio = {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}
    with pytest.raises(ValueError, match="does not accept audio input"):
        normalize_messages([{"role": "user", "content": [audio]}])
    kept = normalize_messages(messages, allow_media={"image"})
    assert kept[0]["content"] == [{"type": "text", "text": "what?"}, image]


def test_tool_calls_and_tool_messages() -> None:
    out = normalize_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    },
                    {"id": "b", "function": {"name": "g", "arguments": "not json"}},
                    {"id": "c", "function": {"name": "h", "arguments": ""}},
                    {"id": "d", "function": {"name": "k", "arguments": {"y": [2]}}},
                ],
            },
            {"role": "tool", "tool_call_id": "a", "name": "f", "content": "ok"},
            {"role": "assistant", "content": "done", "tool_calls": [], "name": None},
        ]
    )
    first = out[0]
    assert "content" not in first  # HF templates expect tool-call turns without content
    assert [c["function"]["arguments"] for c in first["tool_calls"]] == [
        {"x": 1},
        "not json",
        {},
        {"y": [2]},
    ]
    assert all(c["type"] == "function" for c in first["tool_calls"])
    assert out[1] == {"role": "tool", "tool_call_id": "a", "name": "f", "content": "ok"}
    assert out[2] == {"role": "assistant", "content": "done"}


# --- strip_think_blocks ------------------------------------------------------------------


def test_strip_think_blocks_rolling_checkpoint() -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>plan 1</think>\n\nanswer 1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>plan 2</think>call", "reasoning_content": "r2"},
        {"role": "tool", "content": "result"},
        {"role": "user", "content": "<tool_response>\nmore\n</tool_response>"},
        {"role": "assistant", "content": "<think>plan 3</think>final"},
    ]
    out = strip_think_blocks(messages)
    assert out[1]["content"] == "answer 1"
    # q2 is the last real user turn: the tool-calling chain after it keeps its reasoning.
    assert out[3] == messages[3]
    assert out[6] == messages[6]
    assert messages[1]["content"].startswith("<think>")  # input untouched

    later = strip_think_blocks([*messages, {"role": "user", "content": "q3"}])
    assert later[3] == {"role": "assistant", "content": "call"}
    assert later[6]["content"] == "final"


def test_strip_think_blocks_without_user_turn_changes_nothing() -> None:
    messages = [{"role": "assistant", "content": "<think>x</think>y"}]
    assert strip_think_blocks(messages) == messages


def test_remove_think_forms() -> None:
    assert remove_think("no reasoning here ") == "no reasoning here "
    assert remove_think("<think>a</think>\nb") == "b"
    assert remove_think("opened by the prompt</think>\n\nanswer") == "answer"
    assert remove_think("x <think>a</think>y <think>b</think>z") == "x y z"
    assert remove_think("answer <think>cut off") == "answer"
    parts = strip_think_blocks(
        [
            {"role": "assistant", "content": [{"type": "text", "text": "<think>t</think>v"}]},
            {"role": "user", "content": "u"},
        ]
    )
    assert parts[0]["content"] == [{"type": "text", "text": "v"}]
