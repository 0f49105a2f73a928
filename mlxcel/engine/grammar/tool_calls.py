"""Grammars for forced tool choice: the output must be calls to the declared tools.

For the tool-call formats whose wire form is JSON inside a fixed wrapper, a forced
`tool_choice` (`required`, or one named function) is also enforced while decoding: the
output is constrained to one or more calls in the model's own wire form, each naming a
declared tool with arguments that match its `parameters` schema, then end of sequence.

    Hermes / Qwen   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    Mistral Nemo    [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    Llama 3.x       <|python_tag|>{"name": ..., "parameters": {...}}

When the prompt ends inside an open reasoning block, the grammar lets the model finish its
reasoning (any text up to the close tag) before the calls. Wrapper markers that are special
tokens are written as token ids, since grammar literals spell text, not special tokens.
Only Lark-capable backends (llguidance) compile these grammars; callers fall back to the
instruction alone when `tool_call_grammar` returns None.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.grammar.base import (
    JSON_WHITESPACE_PATTERN,
    CompiledGrammar,
    GrammarBackend,
)
from mlxcel.engine.grammar.limits import canonical_schema
from mlxcel.engine.grammar.strict import llama_cpp_schema

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCallWire:
    """How one format writes its calls: wrapper text around JSON call objects."""

    open: str
    close: str = ""
    separator: str = "\n"
    arguments_key: str = "arguments"
    as_array: bool = False  # all calls in one JSON array after a single `open`


WIRES: dict[str, ToolCallWire] = {
    "hermes": ToolCallWire(open="<tool_call>\n", close="\n</tool_call>", separator="\n"),
    "mistral_nemo": ToolCallWire(open="[TOOL_CALLS]", as_array=True),
    "llama3": ToolCallWire(open="<|python_tag|>", separator="; ", arguments_key="parameters"),
}
"""Formats (by tool-call format name) whose forced choices get a grammar."""

MAX_CALLS = 8
"""Calls one constrained answer may hold (bounded, so a weak model still ends)."""


def call_schema(tools: Sequence[Mapping[str, Any]], arguments_key: str) -> dict[str, Any]:
    """A JSON schema matching one call object to any of `tools` (OpenAI function tools)."""
    options: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        if not isinstance(parameters, Mapping) or not parameters:
            parameters = {"type": "object"}
        parameters = llama_cpp_schema(parameters)  # no undeclared keys, bounded integers
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    arguments_key: parameters,
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    if not options:
        raise ValueError("no function tools to call")
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_block(schema: Mapping[str, Any]) -> str:
    """`%json {...}` with whitespace bounded as for response_format."""
    bounded = {
        "x-guidance": {"whitespace_pattern": JSON_WHITESPACE_PATTERN, "lenient": False},
        **schema,
    }
    return "%json " + json.dumps(bounded, ensure_ascii=False)


def _literal(text: str, special_id: Callable[[str], int | None]) -> str:
    """`text` as a Lark item: the special token's id when it is one, else the text."""
    stripped = text.strip()
    token = special_id(stripped) if stripped else None
    if token is None:
        return json.dumps(text, ensure_ascii=False)
    items = [f"<[{token}]>"]
    head, tail = text[: text.index(stripped)], text[text.index(stripped) + len(stripped) :]
    if head:
        items.insert(0, json.dumps(head))
    if tail:
        items.append(json.dumps(tail))
    return " ".join(items)


def tool_call_lark(
    wire: ToolCallWire,
    tools: Sequence[Mapping[str, Any]],
    *,
    special_id: Callable[[str], int | None],
    reasoning_close: str | None = None,
    max_calls: int = MAX_CALLS,
) -> str:
    """The Lark grammar (llguidance dialect) of one or more calls to `tools` in `wire` form.

    `special_id(text)` is the id of the special token spelled `text`, or None. With
    `reasoning_close`, the output first finishes an open reasoning block. At most
    `max_calls` calls (1 for a named choice or `parallel_tool_calls: false`).
    """
    max_calls = max(1, min(max_calls, MAX_CALLS))
    schema = call_schema(tools, wire.arguments_key)
    rules: list[str] = []
    if wire.as_array:
        array = {"type": "array", "items": schema, "minItems": 1, "maxItems": max_calls}
        rules.append(f"calls: {_literal(wire.open, special_id)} call_list")
        rules.append(f"call_list: {_json_block(array)}")
    else:
        parts = [_literal(wire.open, special_id), "call_json"]
        if wire.close:
            parts.append(_literal(wire.close, special_id))
        more = f" ({json.dumps(wire.separator)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
        rules.append(f"calls: call{more}")
        rules.append("call: " + " ".join(parts))
        rules.append(f"call_json: {_json_block(schema)}")
    if reasoning_close is None:
        start = "start: calls"
    else:
        token = special_id(reasoning_close)
        if token is not None:
            rules.append("thinking: THOUGHT " + f"<[{token}]>")
            rules.append("THOUGHT: /(?s:.*)/")
        else:
            rules.append(f"thinking[stop={json.dumps(reasoning_close)}]: /(?s:.*)/")
        rules.append("gap: /\\n{0,2}/")
        start = "start: thinking gap calls"
    return "\n".join([start, *rules]) + "\n"


def special_token_lookup(tokenizer: Any, backend: GrammarBackend) -> Callable[[str], int | None]:
    """`special_id` for `tool_call_lark`: the id of the special token spelled `text`."""

    def special_id(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special=False)
        if len(ids) == 1 and backend.is_special_token(ids[0]):
            return int(ids[0])
        return None

    return special_id


def tool_call_grammar(
    backend: GrammarBackend,
    format_name: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    special_id: Callable[[str], int | None],
    reasoning_close: str | None = None,
    max_calls: int = MAX_CALLS,
) -> CompiledGrammar | None:
    """The compiled forced-call grammar, or None where it does not apply.

    None when the format has no JSON wire form, the backend has no Lark front end, a
    tool's schema is over the limits, or the engine rejects the grammar: the caller then
    relies on the instruction alone (as the spec says for schemas it cannot express).
    """
    wire = WIRES.get(format_name or "")
    if wire is None or not tools or not backend.supports_lark:
        return None
    try:
        for tool in tools:
            function = tool.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("parameters"), Mapping):
                canonical_schema(function["parameters"], backend.limits)
        grammar = tool_call_lark(
            wire,
            tools,
            special_id=special_id,
            reasoning_close=reasoning_close,
            max_calls=max_calls,
        )
        return backend.compile_lark(grammar)
    except (InvalidRequestError, ValueError) as exc:
        log.warning("forced tool_choice: no call grammar (%s); instruction only", exc)
        return None
