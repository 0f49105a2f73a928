"""Argument values of formats whose calls are not JSON: typing by schema, loose literals,
Python-style calls, and the JSON text the arguments become."""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Longest text handed to Python's parser (it is linear, but memory grows with size).
MAX_LITERAL_CHARS = 200_000

_JSON_NAMES = {"true": True, "false": False, "null": None}


def schema_types(schema: Any) -> frozenset[str]:
    """The JSON types a parameter schema allows ("type", a type list, anyOf/oneOf, a string
    enum); empty when the schema says nothing."""
    if not isinstance(schema, Mapping):
        return frozenset()
    found: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                found |= schema_types(branch)
    if not found:
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            found.add("string")
    return frozenset(found)


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter value written as plain text, typed by its schema.

    String parameters keep the text exactly. Anything else is read as JSON, then as a loose
    literal (Python spellings such as True, None, single quotes); text that is neither
    stays a string.
    """
    types = schema_types(schema)
    if types and types <= {"string"}:
        return raw
    ok, value = read_literal(raw.strip())
    return value if ok else raw


def read_literal(text: str) -> tuple[bool, Any]:
    """(True, value) if `text` is JSON or a plain Python literal, else (False, None)."""
    if not text or len(text) > MAX_LITERAL_CHARS:
        return False, None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        pass
    else:
        return (True, value) if _finite(value) else (False, None)
    try:
        node = ast.parse(text, mode="eval").body
        value = literal(node)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return False, None
    return (True, value) if _finite(value) else (False, None)


def literal(node: ast.AST) -> Any:
    """A JSON-compatible value from a literal expression node; ValueError otherwise.

    Accepts numbers, strings, booleans and None in Python or JSON spelling, lists, tuples
    (as lists) and dicts with string keys.
    """
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (bool, int, float, str)):
            return node.value
        raise ValueError("unsupported constant")
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = literal(node.operand)
        if isinstance(operand, bool) or not isinstance(operand, (int, float)):
            raise ValueError("sign on a non-number")
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise ValueError("dict unpacking")
            name = literal(key)
            if not isinstance(name, str):
                raise ValueError("dict key is not a string")
            out[name] = literal(value)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def _finite(value: Any) -> bool:
    """True if `value` has no NaN or infinity anywhere (they are not JSON)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return True


def dumps(value: Any) -> str:
    """JSON text for a value (non-ASCII kept as is)."""
    return json.dumps(value, ensure_ascii=False)


def member_text(key: str, value: Any) -> str:
    """One `"key": value` member as it appears in an arguments string."""
    return f"{dumps(key)}: {dumps(value)}"


def arguments_json(pairs: Sequence[tuple[str, Any]]) -> str:
    """The arguments string for (key, value) pairs, in the order written."""
    return "{" + ", ".join(member_text(k, v) for k, v in pairs) + "}"


def typed_arguments(pairs: Sequence[tuple[str, str]], properties: Mapping[str, Any]) -> str:
    """Arguments from raw (key, text) pairs, each value typed by `properties[key]`."""
    return arguments_json([(k, convert_value(v, properties.get(k))) for k, v in pairs])


def parse_pythonic(text: str) -> list[tuple[str, str]] | None:
    """Calls written as Python: `[f(a=1), g(b="x")]` or `f(a=1)`.

    Returns [(name, arguments JSON)], or None if the text is not only such calls. Names may
    be dotted; a trailing `.call` is dropped (`brave_search.call(query="x")`). Positional
    arguments are not accepted.
    """
    body = text.strip()
    if not body or len(body) > MAX_LITERAL_CHARS:
        return None
    try:
        node = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    calls: list[tuple[str, str]] = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args:
            return None
        name = _dotted(item.func)
        if name is None:
            return None
        if name.endswith(".call"):
            name = name[: -len(".call")]
        pairs: list[tuple[str, Any]] = []
        try:
            for keyword in item.keywords:
                if keyword.arg is None:
                    return None
                pairs.append((keyword.arg, literal(keyword.value)))
        except (ValueError, RecursionError):
            return None
        if not all(_finite(v) for _, v in pairs):
            return None
        calls.append((name, arguments_json(pairs)))
    return calls


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))
