"""The 19 tool-call formats: whole-output parse, streaming at every split, detection."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import pytest
from fixtures.tool_call_samples import (
    DETECTION,
    MARKERS,
    SAMPLES,
    TOOLS,
    VERBATIM_JSON,
    Sample,
)

from mlxcel.engine.chat.reasoning import THINK
from mlxcel.engine.chat.tool_calls import (
    FORMAT_NAMES,
    ContentDelta,
    Delta,
    ParseResult,
    ToolCall,
    ToolCallDelta,
    collect,
    detect_format,
    get_format,
)
from mlxcel.engine.chat.tool_calls.assembler import StreamingToolCallAssembler
from mlxcel.engine.chat.tool_calls.base import ToolCallEnd
from mlxcel.engine.chat.tool_calls.output import (
    ChatOutputStream,
    finish_reason,
    parse_chat_output,
)
from mlxcel.engine.chat.tool_calls.values import convert_value, parse_pythonic
from mlxcel.server.openai_chat.encoder import delta_objects, message_fields

CASES = [(fmt, s) for fmt, samples in SAMPLES.items() for s in samples]
IDS = [f"{fmt}-{s.id}" for fmt, s in CASES]


def stream(fmt: str, pieces: Sequence[str]) -> list[Delta]:
    """Feed `pieces` to a fresh filter of `fmt`; all deltas, finish included."""
    stream_filter = get_format(fmt).stream_filter(TOOLS)
    deltas: list[Delta] = []
    for piece in pieces:
        deltas.extend(stream_filter.feed(piece))
    deltas.extend(stream_filter.finish())
    return deltas


def expected(sample: Sample) -> ParseResult:
    calls = tuple(ToolCall(name, arguments) for name, arguments in sample.calls)
    return ParseResult(sample.content, calls, sample.reasoning)


def plain(result: ParseResult) -> ParseResult:
    """The result without model-given ids (compared separately)."""
    return ParseResult(
        result.content,
        tuple(ToolCall(c.name, c.arguments) for c in result.calls),
        result.reasoning,
    )


def test_registry_has_the_19_formats() -> None:
    assert len(FORMAT_NAMES) == 19
    assert set(SAMPLES) == set(FORMAT_NAMES)
    for name in FORMAT_NAMES:
        assert get_format(name).name == name
    with pytest.raises(KeyError, match="unknown tool-call format"):
        get_format("nope")


def test_every_format_has_several_samples() -> None:
    for name in FORMAT_NAMES:
        samples = SAMPLES[name]
        assert len(samples) >= 3, name
        assert any(len(s.calls) >= 2 for s in samples), f"{name} needs a parallel-call sample"
        assert any(not s.calls for s in samples), f"{name} needs a no-call (false start) sample"


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_parse(fmt: str, sample: Sample) -> None:
    result = get_format(fmt).parse(sample.text, TOOLS)
    assert plain(result) == expected(sample)
    for _, arguments in sample.calls:
        json.loads(arguments)  # every arguments string is JSON


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_stream_matches_parse_at_every_split(fmt: str, sample: Sample) -> None:
    whole = get_format(fmt).parse(sample.text, TOOLS)
    text = sample.text
    # One character at a time: every boundary at once.
    assert collect(stream(fmt, list(text))) == whole
    # Each single boundary.
    for at in range(1, len(text)):
        assert collect(stream(fmt, [text[:at], text[at:]])) == whole, f"split at {at}"
    # Random multi-character splits.
    rng = random.Random(f"{fmt}/{sample.id}")
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert collect(stream(fmt, pieces)) == whole, f"pieces {pieces}"


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_no_marker_leaks_into_content(fmt: str, sample: Sample) -> None:
    deltas = stream(fmt, list(sample.text))
    for marker in MARKERS[fmt]:
        if marker in sample.content:
            continue
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                assert marker not in delta.text
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    assert content == sample.content


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_call_deltas_shape(fmt: str, sample: Sample) -> None:
    """Each call opens once with its name, then only fragments; numbering is 0, 1, ..."""
    deltas = [d for d in stream(fmt, list(sample.text)) if isinstance(d, ToolCallDelta)]
    opened: list[int] = []
    fragments: dict[int, int] = {}
    for delta in deltas:
        if delta.name is not None:
            assert delta.index not in opened
            assert delta.arguments_fragment == ""
            opened.append(delta.index)
        else:
            assert delta.index in opened
            assert delta.arguments_fragment
            fragments[delta.index] = fragments.get(delta.index, 0) + 1
    assert opened == list(range(len(sample.calls)))
    if not get_format(fmt).streams_arguments:
        # One start chunk and one arguments chunk per call.
        assert all(fragments.get(i) == 1 for i in opened)


VERBATIM_CASES = [
    (fmt, s)
    for fmt, s in CASES
    if fmt in VERBATIM_JSON and s.calls and s.id not in ("python_code", "builtin_call")
]


@pytest.mark.parametrize(
    ("fmt", "sample"), VERBATIM_CASES, ids=[f"{f}-{s.id}" for f, s in VERBATIM_CASES]
)
def test_json_arguments_are_verbatim(fmt: str, sample: Sample) -> None:
    result = get_format(fmt).parse(sample.text, TOOLS)
    for call in result.calls:
        as_string = json.dumps(call.arguments, ensure_ascii=False)  # string-valued arguments
        assert call.arguments == "{}" or call.arguments in sample.text or as_string in sample.text


# (format, output, where the arguments start, where they end)
STREAMING_CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "a long query", "limit": 2}}'
        "\n</tool_call>",
        '{"query"',
        "}}",
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=search>\n<parameter=query>\nq\n</parameter>\n"
        "<parameter=limit>\n2\n</parameter>\n</function>\n</tool_call>",
        "<parameter=query>",
        "</function>",
    ),
    (
        "mistral_nemo",
        '[TOOL_CALLS][{"name": "search", "arguments": {"query": "a long query", "limit": 2}}]',
        '{"query"',
        "}}",
    ),
    (
        "mistral_bracketed",
        '[TOOL_CALLS]search[ARGS]{"query": "a long query", "limit": 2}',
        '{"query"',
        "2}",
    ),
    (
        "llama3",
        '{"name": "search", "parameters": {"query": "a long query", "limit": 2}}',
        '{"query"',
        "}}",
    ),
]


@pytest.mark.parametrize(
    ("fmt", "text", "begin", "end"), STREAMING_CASES, ids=[c[0] for c in STREAMING_CASES]
)
def test_streaming_formats_send_name_and_arguments_early(
    fmt: str, text: str, begin: str, end: str
) -> None:
    """The name comes before the arguments start; arguments flow before they end."""
    assert get_format(fmt).streams_arguments
    stream_filter = get_format(fmt).stream_filter(TOOLS)
    name_at = -1
    early: list[str] = []
    last = text.rindex(end)
    for at, char in enumerate(text):
        for delta in stream_filter.feed(char):
            if isinstance(delta, ToolCallDelta):
                if delta.name is not None:
                    name_at = at
                elif at < last:
                    early.append(delta.arguments_fragment)
    assert 0 <= name_at <= text.index(begin)
    assert len(early) >= 2


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if not get_format(f).streams_arguments])
def test_other_formats_send_each_call_whole(fmt: str) -> None:
    sample = next(s for s in SAMPLES[fmt] if s.calls)
    stream_filter = get_format(fmt).stream_filter(TOOLS)
    steps = [stream_filter.feed(c) for c in sample.text] + [stream_filter.finish()]
    for step in steps:
        calls = [d for d in step if isinstance(d, ToolCallDelta)]
        starts = [d for d in calls if d.name is not None]
        for start in starts:  # the start and the whole arguments come in the same step
            assert [d.index for d in calls].count(start.index) == 2


# -- schema conversion --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("123", {"type": "string"}, "123"),
        (" padded ", {"type": "string"}, " padded "),
        ("true", {"type": "string"}, "true"),
        ("3", {"type": "integer"}, 3),
        (" 2.50 ", {"type": "number"}, 2.5),
        ("True", {"type": "boolean"}, True),
        ("null", {"type": ["string", "null"]}, None),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': (1, None)}", {"type": "object"}, {"a": [1, None]}),
        ("['x', \"y\"]", {"type": "array"}, ["x", "y"]),
        ("not json", {"type": "object"}, "not json"),
        ("nan", {"type": "number"}, "nan"),
        ("celsius", {"enum": ["celsius", "fahrenheit"]}, "celsius"),
        ("7", None, 7),
        ("hello", None, "hello"),
        ("__import__('os')", {"type": "object"}, "__import__('os')"),
    ],
)
def test_convert_value_by_schema(raw: str, schema: object, value: object) -> None:
    assert convert_value(raw, schema) == value


@pytest.mark.parametrize("fmt", ["glm47", "longcat", "minimax_m3", "minimax_m2", "qwen3_coder"])
def test_schema_conversion_formats(fmt: str) -> None:
    bodies = {
        "glm47": "<tool_call>search<arg_key>query</arg_key><arg_value>42</arg_value>"
        "<arg_key>limit</arg_key><arg_value>7</arg_value>"
        "<arg_key>exact</arg_key><arg_value>True</arg_value></tool_call>",
        "longcat": "<longcat_tool_call>search<longcat_arg_key>query</longcat_arg_key>"
        "<longcat_arg_value>42</longcat_arg_value><longcat_arg_key>limit</longcat_arg_key>"
        "<longcat_arg_value>7</longcat_arg_value><longcat_arg_key>exact</longcat_arg_key>"
        "<longcat_arg_value>True</longcat_arg_value></longcat_tool_call>",
        "minimax_m3": ']<]minimax[>[<tool_call>]<]minimax[>[<invoke name="search">'
        "]<]minimax[>[<query>42]<]minimax[>[</query>]<]minimax[>[<limit>7]<]minimax[>[</limit>"
        "]<]minimax[>[<exact>True]<]minimax[>[</exact>]<]minimax[>[</invoke>]<]minimax[>[</tool_call>",
        "minimax_m2": '<minimax:tool_call><invoke name="search"><parameter name="query">42'
        '</parameter><parameter name="limit">7</parameter><parameter name="exact">True'
        "</parameter></invoke></minimax:tool_call>",
        "qwen3_coder": "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
        "<parameter=limit>\n7\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
        "</function>\n</tool_call>",
    }
    (call,) = get_format(fmt).parse(bodies[fmt], TOOLS).calls
    arguments = json.loads(call.arguments)
    assert arguments["query"] == "42"  # a string parameter keeps its text
    assert arguments["limit"] == 7
    assert arguments["exact"] is True
    # Without a schema the same text is read as JSON (or kept when it is not JSON).
    (untyped,) = get_format(fmt).parse(bodies[fmt], None).calls
    assert json.loads(untyped.arguments)["query"] == 42


def test_pythonic_refuses_non_literals() -> None:
    assert parse_pythonic("[f(x=__import__('os'))]") is None
    assert parse_pythonic("[f(1, 2)]") is None
    assert parse_pythonic("[f(**kw)]") is None
    assert parse_pythonic("f(a=[1, {'b': False}])") == [("f", '{"a": [1, {"b": false}]}')]


# -- detection ----------------------------------------------------------------------------


@pytest.mark.parametrize(("snippet", "name"), DETECTION, ids=[str(n) for _, n in DETECTION])
def test_detect_format(snippet: str, name: str | None) -> None:
    assert detect_format(snippet) == name


def test_detection_covers_every_format() -> None:
    assert {n for _, n in DETECTION if n} == set(FORMAT_NAMES)


# -- untrusted output ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_pathological_output_runs_in_bounded_time(fmt: str) -> None:
    """Repetitive, unbalanced and deeply nested text: linear-ish, no blow-up."""
    texts = [
        "<tool_call>" * 2000,
        "{" * 5000 + '"name"' * 1000,
        "[" * 5000,
        '{"name": "search", "arguments": ' + "[" * 3000,
        "<|channel|>" * 2000,
        ">>>" * 3000,
        "Action:\n" * 1000,
        "\\" * 5000,
        '"' * 5000,
    ]
    start = time.perf_counter()
    for text in texts:
        get_format(fmt).parse(text, TOOLS)
        chunks = [text[i : i + 7] for i in range(0, len(text), 7)]
        collect(stream(fmt, chunks))
    assert time.perf_counter() - start < 10


def test_long_streamed_arguments_are_linear() -> None:
    payload = ", ".join(f'"k{i}": "{"x" * 20}"' for i in range(2000))
    text = '<tool_call>\n{"name": "search", "arguments": {' + payload + "}}\n</tool_call>"
    start = time.perf_counter()
    deltas = stream("hermes", [text[i : i + 3] for i in range(0, len(text), 3)])
    assert time.perf_counter() - start < 5
    (call,) = collect(deltas).calls
    assert call.arguments == "{" + payload + "}"


# -- assembler ----------------------------------------------------------------------------


def test_assembler_chunk_shapes_and_stable_ids() -> None:
    ids = iter(["call_a", "call_b"])
    assembler = StreamingToolCallAssembler(new_id=lambda: next(ids))
    pieces = delta_objects(
        assembler.step(
            [
                ContentDelta("Hi"),
                ContentDelta(" there"),
                ToolCallDelta(0, name="get_weather"),
                ToolCallDelta(0, arguments_fragment='{"city"'),
                ToolCallDelta(0, arguments_fragment=': "Paris"}'),
            ]
        )
    )
    assert pieces == [
        {"content": "Hi there"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]},
    ]
    assert assembler.step([]) == []
    final = ParseResult("Hi there", (ToolCall("get_weather", '{"city": "Paris"}'),))
    assert assembler.reconcile(final) == [ToolCallEnd(0)]  # nothing owed; the call ends
    assert assembler.calls()[0].id == "call_a"


def test_assembler_sends_the_missing_remainder_and_unstreamed_calls() -> None:
    ids = iter(["call_a", "call_b"])
    assembler = StreamingToolCallAssembler(new_id=lambda: next(ids), request_id="req-1")
    assembler.step([ToolCallDelta(0, name="f"), ToolCallDelta(0, arguments_fragment='{"a"')])
    final = ParseResult("", (ToolCall("f", '{"a": 1}'), ToolCall("g", "{}", id="functions.g:1")))
    pieces = delta_objects(assembler.reconcile(final))
    assert pieces == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "functions.g:1",
                    "type": "function",
                    "function": {"name": "g", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    assert [c.id for c in assembler.calls()] == ["call_a", "functions.g:1"]


def test_assembler_logs_a_mismatch_with_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    assembler = StreamingToolCallAssembler(new_id=lambda: "call_x", request_id="req-42")
    assembler.step([ToolCallDelta(0, name="f"), ToolCallDelta(0, arguments_fragment='{"a": 2')])
    with caplog.at_level(logging.WARNING):
        events = assembler.reconcile(ParseResult("", (ToolCall("f", '{"a": 1}'),)))
    assert events == [ToolCallEnd(0)]  # nothing sent to "fix" it
    assert any("req-42" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_mistral_ids_are_nine_characters() -> None:
    call_id = get_format("mistral_nemo").new_call_id()
    assert len(call_id) == 9 and call_id.isalnum()
    assert get_format("hermes").new_call_id().startswith("call_")


# -- whole pipeline -----------------------------------------------------------------------

QWEN3_OUTPUT = (
    "<think>\nThe user wants Paris weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def _run(out: ChatOutputStream, tokens: Sequence[str]) -> list[list[dict[str, Any]]]:
    """The chat `delta` objects of each step (one per token, then the finish)."""
    steps = [delta_objects(out.feed(t)) for t in tokens]
    steps.append(delta_objects(out.finish()))
    return steps


def test_chat_output_stream_reasoning_content_and_calls() -> None:
    tokens = [QWEN3_OUTPUT[i : i + 3] for i in range(0, len(QWEN3_OUTPUT), 3)]
    out = ChatOutputStream(
        tool_format=get_format("hermes"), tools=TOOLS, reasoning=THINK, request_id="r"
    )
    steps = _run(out, tokens)
    pieces = [p for step in steps for p in step]
    reasoning = "".join(str(p.get("reasoning_content", "")) for p in pieces)
    content = "".join(str(p.get("content", "")) for p in pieces)
    assert reasoning == "The user wants Paris weather."
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert out.result == parse_chat_output(
        QWEN3_OUTPUT, tool_format=get_format("hermes"), tools=TOOLS, reasoning=THINK
    )
    assert out.result is not None and finish_reason(out.result, "stop") == "tool_calls"
    assert finish_reason(out.result, "length") == "length"
    # Held or suppressed tokens produce no piece: the serving layer sends a placeholder.
    assert any(step == [] for step in steps)
    for piece in pieces:
        assert "<" not in str(piece.get("content", ""))


def test_message_fields() -> None:
    result = parse_chat_output(
        QWEN3_OUTPUT, tool_format=get_format("hermes"), tools=TOOLS, reasoning=THINK
    )
    message = message_fields(result, tool_format=get_format("hermes"))
    assert message["content"] == "Let me check."
    assert message["reasoning_content"] == "The user wants Paris weather."
    assert message["tool_calls"][0]["id"].startswith("call_")
    assert "reasoning_only" not in message
    only = parse_chat_output("<think>still thinking", reasoning=THINK)
    assert message_fields(only) == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "still thinking",
        "reasoning_only": True,
    }
    calls_only = parse_chat_output(
        '<tool_call>{"name": "get_time"}</tool_call>', tool_format=get_format("hermes")
    )
    assert message_fields(calls_only)["content"] is None


def test_chat_output_stream_harmony_and_reasoning_only_flag() -> None:
    text = "<|channel|>analysis<|message|>Only thinking here"
    out = ChatOutputStream(tool_format=get_format("harmony"), tools=TOOLS)
    _run(out, list(text))
    assert out.reasoning_only and not out.content_sent
    assert out.result == ParseResult("", (), "Only thinking here")


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_chat_output_stream_reconciles_to_the_parse(fmt: str, sample: Sample) -> None:
    out = ChatOutputStream(tool_format=get_format(fmt), tools=TOOLS, request_id="x")
    steps = _run(out, [sample.text[i : i + 2] for i in range(0, len(sample.text), 2)])
    assert out.result is not None
    calls = out.tool_calls
    assert [(c.name, c.arguments) for c in calls] == list(sample.calls)
    sent_content = "".join(str(p.get("content", "")) for s in steps for p in s)
    assert sent_content == sample.content
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("defer", [True, False])
def test_whole_calls_are_sent_at_the_end_unless_told_otherwise(defer: bool) -> None:
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        "\nAnd some words after the call."
    )
    out = ChatOutputStream(tool_format=get_format("glm47"), tools=TOOLS, defer_whole_calls=defer)
    during = [p for ch in text for p in delta_objects(out.feed(ch))]
    end = delta_objects(out.finish())
    call_pieces = [p for p in during + end if "tool_calls" in p]
    assert len(call_pieces) == 2  # one start object, one arguments object
    assert call_pieces[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert call_pieces[1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Paris"}'}
    assert all("tool_calls" not in p for p in during) == defer
    assert "".join(str(p.get("content", "")) for p in during + end) == (
        "And some words after the call."
    )
