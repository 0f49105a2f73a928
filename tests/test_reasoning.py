"""Reasoning split: think tags, prompts that open the block, Harmony channels, streaming."""

from __future__ import annotations

import random

import pytest

from mlxcel.engine.chat.reasoning import (
    HARMONY,
    THINK,
    ReasoningConfig,
    ThinkFilter,
    detect_reasoning,
    prompt_opens_reasoning,
    reasoning_filter,
    split_reasoning,
)
from mlxcel.engine.chat.tool_calls import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    ToolCallDelta,
    collect,
    get_format,
)
from mlxcel.engine.chat.tool_calls.output import ChatOutputStream, parse_chat_output

COMMAND_R = ReasoningConfig("<|START_THINKING|>", "<|END_THINKING|>")

# (config, start_in_reasoning, output, reasoning, content)
CASES: list[tuple[ReasoningConfig, bool, str, str | None, str]] = [
    (THINK, False, "<think>\nThe user says hi.\n</think>\n\nHello!", "The user says hi.", "Hello!"),
    (THINK, False, "  <think>a < b </thinker> c</think>Done", "a < b </thinker> c", "Done"),
    (
        THINK,
        False,
        "No thinking here. <think>x</think>",
        None,
        "No thinking here. <think>x</think>",
    ),
    (THINK, False, "<think>\n\n</think>\n\nQuick answer.", None, "Quick answer."),
    (THINK, False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (
        THINK,
        False,
        "<thinking>is not the tag</thinking>",
        None,
        "<thinking>is not the tag</thinking>",
    ),
    (THINK, False, "<thin", None, "<thin"),
    (THINK, False, "\n\n", None, "\n\n"),
    (THINK, False, "思考なし。", None, "思考なし。"),
    (THINK, True, "Let me think…\n</think>\n\nParis.", "Let me think…", "Paris."),
    (THINK, True, "<think>\nrepeated open tag</think>ok", "repeated open tag", "ok"),
    (THINK, True, "never closed", "never closed", ""),
    (THINK, True, "</think>Straight to the answer.", None, "Straight to the answer."),
    (
        COMMAND_R,
        False,
        "<|START_THINKING|>Plan.<|END_THINKING|><|START_RESPONSE|>Hi",
        "Plan.",
        "<|START_RESPONSE|>Hi",
    ),
    (
        HARMONY,
        False,
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Answer.",
        "Hmm.",
        "Answer.",
    ),
]
IDS = [f"{i}-{case[2][:20]}" for i, case in enumerate(CASES)]


def run(config: ReasoningConfig, opened: bool, pieces: list[str]) -> list[Delta]:
    stream = reasoning_filter(config, start_in_reasoning=opened)
    assert stream is not None
    deltas: list[Delta] = []
    for piece in pieces:
        deltas.extend(stream.feed(piece))
    deltas.extend(stream.finish())
    return deltas


@pytest.mark.parametrize(("config", "opened", "text", "reasoning", "content"), CASES, ids=IDS)
def test_split(
    config: ReasoningConfig, opened: bool, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(text, config, start_in_reasoning=opened) == (reasoning, content)


@pytest.mark.parametrize(("config", "opened", "text", "reasoning", "content"), CASES, ids=IDS)
def test_streaming_matches_at_every_split(
    config: ReasoningConfig, opened: bool, text: str, reasoning: str | None, content: str
) -> None:
    whole = collect(run(config, opened, [text]))
    assert collect(run(config, opened, list(text))) == whole
    for at in range(1, len(text)):
        assert collect(run(config, opened, [text[:at], text[at:]])) == whole
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(len(text) - 1, 5)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert collect(run(config, opened, pieces)) == whole
    # Tags never show up in either channel (unless the text is not a reasoning block).
    for delta in run(config, opened, list(text)):
        if isinstance(delta, ReasoningDelta):
            assert config.close_tag not in delta.text or not config.close_tag
            assert "<|channel|>" not in delta.text


def test_reasoning_streams_before_it_closes() -> None:
    stream = ThinkFilter(THINK)
    text = "<think>one two three four</think>answer"
    seen: list[tuple[int, Delta]] = []
    for at, char in enumerate(text):
        seen.extend((at, d) for d in stream.feed(char))
    first_reasoning = next(at for at, d in seen if isinstance(d, ReasoningDelta))
    assert first_reasoning < text.index("</think>")
    kinds = [type(d) for _, d in seen]
    assert kinds.index(ContentDelta) > max(i for i, k in enumerate(kinds) if k is ReasoningDelta)


@pytest.mark.parametrize(
    ("snippet", "config"),
    [
        ("{% if thinking %}<think>\n{% endif %}...</think>", THINK),
        ("<|START_THINKING|>{{ t }}<|END_THINKING|>", COMMAND_R),
        ("<seed:think>x</seed:think>", ReasoningConfig("<seed:think>", "</seed:think>")),
        ("<|start|>assistant<|channel|>analysis<|message|>", HARMONY),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_detect_reasoning(snippet: str | None, config: ReasoningConfig | None) -> None:
    assert detect_reasoning(snippet) == config


def test_prompt_opens_reasoning() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", THINK)
    assert not prompt_opens_reasoning("<|start|>assistant", HARMONY)
    assert not prompt_opens_reasoning("<think>", None)


def test_no_config_means_no_split() -> None:
    assert reasoning_filter(None) is None
    assert split_reasoning("<think>x</think>y", None) == (None, "<think>x</think>y")


def test_reasoning_then_tool_calls_when_the_prompt_opened_the_block() -> None:
    text = (
        "The user wants weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    hermes = get_format("hermes")
    result = parse_chat_output(text, tool_format=hermes, reasoning=THINK, start_in_reasoning=True)
    assert result.reasoning == "The user wants weather."
    assert result.content == ""
    assert [(c.name, c.arguments) for c in result.calls] == [("get_weather", '{"city": "Paris"}')]
    out = ChatOutputStream(tool_format=hermes, reasoning=THINK, start_in_reasoning=True)
    events = [e for ch in text for e in out.feed(ch)] + out.finish()
    assert out.result == result
    assert not out.content_sent and not out.reasoning_only
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == result.reasoning
    # A tool call written inside the reasoning is not a call.
    inner = parse_chat_output(
        '<think><tool_call>{"name": "x"}</tool_call></think>Hi',
        tool_format=hermes,
        reasoning=THINK,
    )
    assert inner.calls == () and inner.content == "Hi"


def test_harmony_reasoning_filter_also_yields_calls() -> None:
    text = (
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    deltas = run(HARMONY, False, list(text))
    assert any(isinstance(d, ToolCallDelta) for d in deltas)
    assert collect(deltas).reasoning == "Call it."
