"""JSON schemas read the way llama.cpp's json-schema-to-grammar reads them.

In JSON Schema an object that lists `properties` but says nothing of
`additionalProperties` accepts any other key too. llama.cpp's grammar generator reads
such an object as closed: only the listed keys, unless the schema says
`additionalProperties: true` or gives a schema for the extra values. It also writes an
integer without bounds in at most 16 digits, and reads a list-valued `items` (draft 4's
tuples) as the exact tuple (`prefixItems`). A weak model given the open reading keeps
inventing keys, or digits, until it runs out of tokens, so constrained output
(response_format, forced tool calls) follows llama.cpp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_LIST = ("anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


INTEGER_DIGITS = 16
"""Digits of an integer without bounds, as llama.cpp's `integral-part` rule writes it."""
_INTEGER_BOUND = 10**INTEGER_DIGITS - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def llama_cpp_schema(schema: Any, *, closable: bool = True) -> Any:
    """A copy of `schema` where every object with `properties` and no word on
    `additionalProperties` gets `additionalProperties: false`, and every integer without
    bounds is limited to `INTEGER_DIGITS` digits (either sign); a list-valued `items`
    becomes `prefixItems` (more items only as `additionalItems` allows).

    `allOf` members stay open (they are merged: closing one would forbid the keys of the
    others), and so does an object that combines its `properties` with an `allOf`.
    """
    if isinstance(schema, list):
        return [llama_cpp_schema(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, Mapping):
            out[key] = {name: llama_cpp_schema(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [llama_cpp_schema(sub, closable=False) for sub in value]
        elif key in _ONE or key in _LIST:
            out[key] = llama_cpp_schema(value)
        else:
            out[key] = value
    if closable and _is_open_object(schema):
        out["additionalProperties"] = False
    if _is_unbounded_integer(schema):
        out["minimum"], out["maximum"] = -_INTEGER_BOUND, _INTEGER_BOUND
    if isinstance(out.get("items"), list):  # a draft-4 tuple: exactly these items
        out["prefixItems"] = out.pop("items")
        out["items"] = out.pop("additionalItems", False)
        out.setdefault("minItems", len(out["prefixItems"]))
        out.setdefault("type", "array")
    return out


def _is_unbounded_integer(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds and "number" not in kinds and not any(b in schema for b in _BOUNDS)


def _is_open_object(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    is_object = kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)
    return (
        is_object
        and isinstance(schema.get("properties"), Mapping)
        and "additionalProperties" not in schema
        and "allOf" not in schema
    )
