"""Forced tool_choice is enforced by a grammar for the JSON wire formats.

End to end: a real `mlxcel serve` on the tiny random-weight llama with a Qwen-style
template (`<tool_call>` JSON, `<think>` reasoning): `required` and a named function must
produce declared calls whose arguments validate, with finish_reason `tool_calls`, streamed
or not. Engine level: the grammars of all three wire forms (Hermes/Qwen, Mistral Nemo,
Llama 3) driven by random logits always parse back, through the format's own parser, to
declared calls with valid arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from openai import OpenAI
from server_harness import API_KEY, ServeProcess
from test_server_tools import QWEN_STYLE_TEMPLATE, THINKING_OPT_IN

from mlxcel.engine.chat.tool_calls import get_format
from mlxcel.engine.chat.tool_calls.output import parse_chat_output
from mlxcel.engine.grammar import get_grammar_backend
from mlxcel.engine.grammar.tool_calls import (
    WIRES,
    special_token_lookup,
    tool_call_grammar,
    tool_call_lark,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


SPACE_RULE = re.compile(r" |\n[ \t]{0,20}")
"""llama.cpp json-schema-to-grammar's SPACE (besides nothing): one space, or one line feed
and up to 20 spaces or tabs."""
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _check_whitespace(json_text: str) -> None:
    """Every run of whitespace between the tokens of `json_text` is one SPACE_RULE."""
    between = _STRING.sub('""', json_text)
    for run in re.findall(r"\s+", between):
        assert SPACE_RULE.fullmatch(run), (run, json_text)


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = ["-m", str(tiny_llama_dir), "-np", "4", "-c", "8192", "--api-key", API_KEY]
    args += ["--chat-template-kwargs", json.dumps(THINKING_OPT_IN)]
    with ServeProcess([*args, "--chat-template-file", str(template)]).start() as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _create(client: OpenAI, seed: int, max_tokens: int = 900, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="m",
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        **kwargs,
    )


def test_required_always_makes_a_declared_call(client: OpenAI) -> None:
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda s: _create(client, s, tool_choice="required"), range(12)))
    names = set()
    for out in answers:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)
            names.add(call.function.name)
    assert names <= set(SCHEMAS)


def test_named_choice_calls_that_function(client: OpenAI) -> None:
    choice_obj = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(4):
        choice = _create(client, seed, tool_choice=choice_obj).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        for call in choice.message.tool_calls:
            _check_call(call.function.name, call.function.arguments)


def test_parallel_tool_calls_false_allows_one_call(client: OpenAI) -> None:
    for seed in range(3):
        choice = _create(client, seed, tool_choice="required", parallel_tool_calls=False)
        calls = choice.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1


def test_streamed_forced_call_reassembles(client: OpenAI) -> None:
    stream = _create(client, 5, tool_choice="required", stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content, delta  # nothing but the call
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            if part.function and part.function.name:
                entry["name"] = part.function.name
            if part.function and part.function.arguments:
                entry["arguments"] += part.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert calls
    for entry in calls.values():
        _check_call(entry["name"], entry["arguments"])


def test_forced_call_after_open_reasoning(client: OpenAI) -> None:
    out = _create(
        client,
        2,
        tool_choice="required",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call.function.name, call.function.arguments)


def test_auto_is_not_constrained(client: OpenAI) -> None:
    """Without forcing, the random model almost never writes a call: no grammar applied."""
    finishes = {_create(client, s, max_tokens=8).choices[0].finish_reason for s in range(3)}
    assert "tool_calls" not in finishes


# ------------------------------------------------------------------ engine level


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading.resolve import load_model

    return load_model(str(tiny_llama_dir)).tokenizer


def _sample_constrained(tokenizer: Any, grammar: Any, seed: int, limit: int = 2000) -> str:
    """Random logits through the grammar mask until it ends: the generated text."""
    backend = grammar.backend
    matcher = grammar.matcher()
    bitmask = backend.allocate_bitmask(1)
    rng = np.random.default_rng(seed)
    eos = set(tokenizer.eos_token_ids)
    ids: list[int] = []
    for _ in range(limit):
        bitmask[:] = 0
        matcher.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[: backend.vocab_size]
        allowed = np.flatnonzero(bits)
        assert allowed.size, "the grammar allowed nothing"
        logits = rng.normal(size=allowed.size)
        token = int(allowed[int(np.argmax(logits))])
        if token in eos:
            break
        assert matcher.accept(token)
        ids.append(token)
    else:
        pytest.fail("the constrained output did not end")
    return str(tokenizer.decode(ids, skip_special=False))


@pytest.mark.parametrize("fmt", sorted(WIRES))
def test_wire_grammars_parse_back_to_declared_calls(tokenizer: Any, fmt: str) -> None:
    backend = get_grammar_backend("llguidance", tokenizer)
    grammar = tool_call_grammar(
        backend, fmt, TOOLS, special_id=special_token_lookup(tokenizer, backend)
    )
    assert grammar is not None
    tool_format = get_format(fmt)
    for seed in range(10):
        text = _sample_constrained(tokenizer, grammar, seed)
        result = parse_chat_output(text, tool_format=tool_format, tools=TOOLS)
        assert result.calls, text
        assert not result.content.strip(), text
        for call in result.calls:
            _check_call(call.name, call.arguments)


TWO_INTEGERS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
}
ADD = [{"type": "function", "function": {"name": "add", "parameters": TWO_INTEGERS}}]


@pytest.mark.parametrize("fmt", sorted(WIRES))
def test_forced_call_whitespace_is_llama_cpp_space_over_20_seeds(tokenizer: Any, fmt: str) -> None:
    """No carriage return, no blank line, at most 20 spaces/tabs after a line feed."""
    backend = get_grammar_backend("llguidance", tokenizer)
    lookup = special_token_lookup(tokenizer, backend)
    grammar = tool_call_grammar(backend, fmt, ADD, special_id=lookup, max_calls=1)
    assert grammar is not None
    wire = WIRES[fmt]
    for seed in range(20):
        text = _sample_constrained(tokenizer, grammar, seed)
        assert text.startswith(wire.open) and text.endswith(wire.close), text
        body = text[len(wire.open) : len(text) - len(wire.close)]
        json.loads(body)
        _check_whitespace(body)


def test_response_format_whitespace_is_llama_cpp_space_over_20_seeds(tokenizer: Any) -> None:
    backend = get_grammar_backend("llguidance", tokenizer)
    for schema in (TWO_INTEGERS, {"type": "object"}):  # the second is what json_object uses
        grammar = backend.compile_json_schema(schema)
        for seed in range(20):
            text = _sample_constrained(tokenizer, grammar, seed)
            assert isinstance(json.loads(text), dict), text
            _check_whitespace(text)


def test_special_markers_become_token_ids(tokenizer: Any) -> None:
    backend = get_grammar_backend("llguidance", tokenizer)
    lookup = special_token_lookup(tokenizer, backend)
    lark = tool_call_lark(WIRES["hermes"], TOOLS[:1], special_id=lookup, reasoning_close="</think>")
    (call_id,) = tokenizer.encode("<tool_call>", add_special=False)
    (close_id,) = tokenizer.encode("</think>", add_special=False)
    assert f"<[{call_id}]>" in lark and f"<[{close_id}]>" in lark
    assert "<tool_call>" not in lark
    # Llama 3's marker is not a special token of this vocabulary: it stays a text literal.
    assert '"<|python_tag|>"' in tool_call_lark(WIRES["llama3"], TOOLS, special_id=lookup)


def test_no_grammar_where_it_cannot_apply(tokenizer: Any) -> None:
    backend = get_grammar_backend("llguidance", tokenizer)
    lookup = special_token_lookup(tokenizer, backend)
    assert tool_call_grammar(backend, "pythonic", TOOLS, special_id=lookup) is None
    assert tool_call_grammar(backend, "hermes", [], special_id=lookup) is None
    too_deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        too_deep = {"type": "object", "properties": {"a": too_deep}}
    deep_tool = [{"type": "function", "function": {"name": "f", "parameters": too_deep}}]
    assert tool_call_grammar(backend, "hermes", deep_tool, special_id=lookup) is None


# ------------------------------------- schemas that do not close their objects themselves

OPEN_WEATHER = {  # no additionalProperties anywhere, as most tool schemas are written
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "when": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
    "required": ["city"],
}
OPEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}}]


def _closed(schema: Any) -> Any:
    """`schema` with every object that lists properties closed (what must come out)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema:
            out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
            out.setdefault("additionalProperties", False)
        return out
    return schema


def test_forced_calls_on_open_schemas_end_in_tool_calls_over_20_seeds(client: OpenAI) -> None:
    """No undeclared keys and bounded whitespace: a random-weight model always finishes."""

    def run(seed: int) -> Any:
        return client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=OPEN_TOOLS,  # type: ignore[arg-type]
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=1200,  # up to MAX_CALLS calls of a few dozen tokens each
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(run, range(20)))
    for seed, choice in enumerate(choices):
        assert choice.finish_reason == "tool_calls", (seed, choice)
        assert choice.message.tool_calls, (seed, choice)
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, _closed(OPEN_WEATHER))
            _check_whitespace(call.function.arguments)


def test_response_format_on_an_open_schema_stops_over_20_seeds(client: OpenAI) -> None:
    schema = {"name": "weather", "schema": OPEN_WEATHER}

    def run(seed: int) -> Any:
        return client.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": schema},  # type: ignore[typeddict-item]
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        choices = list(pool.map(run, range(20)))
    for seed, choice in enumerate(choices):
        assert choice.finish_reason == "stop", (seed, choice)
        text = choice.message.content or ""
        jsonschema.validate(json.loads(text), _closed(OPEN_WEATHER))
        _check_whitespace(text)


def test_llama_cpp_schema_closes_objects() -> None:
    from mlxcel.engine.grammar.strict import llama_cpp_schema

    closed = llama_cpp_schema(
        {
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {}}},
                "b": {"type": "object", "properties": {}, "additionalProperties": True},
                "c": {"type": "object", "additionalProperties": {"type": "integer"}},
                "d": {"type": "array", "items": {"properties": {"y": {}}}},
                "e": {"type": "object"},
            },
            "$defs": {"n": {"properties": {"z": {}}}},
            "anyOf": [{"properties": {"k": {}}}],
        }
    )
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["additionalProperties"] is True  # said so: stays open
    assert props["c"]["additionalProperties"]["type"] == "integer"  # a schema: kept
    assert props["d"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["e"]  # no properties: any object
    assert closed["$defs"]["n"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    # allOf members are merged, so none of them is closed on its own
    merged = llama_cpp_schema({"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]})
    assert all("additionalProperties" not in part for part in merged["allOf"])


def test_integers_without_bounds_get_llama_cpp_sixteen_digits() -> None:
    from mlxcel.engine.grammar.strict import llama_cpp_schema

    top = 10**16 - 1
    read = llama_cpp_schema(
        {
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"type": ["integer", "null"]},
                "c": {"type": "integer", "minimum": 0},  # a bound given: left as it is
                "d": {"type": "number"},
                "e": {"type": "array", "items": {"type": "integer"}},
            },
        }
    )
    props = read["properties"]
    assert (props["a"]["minimum"], props["a"]["maximum"]) == (-top, top)
    assert props["b"]["maximum"] == top
    assert props["c"] == {"type": "integer", "minimum": 0}
    assert props["d"] == {"type": "number"}
    assert props["e"]["items"]["maximum"] == top


def test_a_list_of_items_is_read_as_a_tuple(tokenizer: Any) -> None:
    from mlxcel.engine.grammar.strict import llama_cpp_schema

    read = llama_cpp_schema({"items": [{"type": "string"}, {"const": 1}]})
    assert read["prefixItems"] == [{"type": "string"}, {"const": 1}]
    assert (read["items"], read["minItems"], read["type"]) == (False, 2, "array")
    more = llama_cpp_schema({"items": [{"const": 1}], "additionalItems": {"const": 2}})
    assert more["items"] == {"const": 2} and "additionalItems" not in more
    grammar = get_grammar_backend("llguidance", tokenizer).compile_json_schema(
        {"items": [{"type": "integer", "minimum": 0, "maximum": 9}]}
    )
    for seed in range(5):
        value = json.loads(_sample_constrained(tokenizer, grammar, seed))
        assert isinstance(value, list) and len(value) == 1 and 0 <= value[0] <= 9, value


def test_forced_call_with_unbounded_integers_ends_over_20_seeds(tokenizer: Any) -> None:
    """Random logits through the grammar: 16 digits at most, so every call ends."""
    open_ints = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": open_ints}}]
    backend = get_grammar_backend("llguidance", tokenizer)
    lookup = special_token_lookup(tokenizer, backend)
    grammar = tool_call_grammar(backend, "hermes", tools, special_id=lookup, max_calls=1)
    assert grammar is not None
    for seed in range(20):
        text = _sample_constrained(tokenizer, grammar, seed, limit=400)
        body = text[len(WIRES["hermes"].open) : len(text) - len(WIRES["hermes"].close)]
        value = json.loads(body)["arguments"]["a"]
        assert isinstance(value, int) and abs(value) < 10**16, text
