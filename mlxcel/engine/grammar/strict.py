"""JSON-schema objects closed the way llama.cpp's json-schema-to-grammar closes them.

In JSON Schema an object that lists `properties` but says nothing of
`additionalProperties` accepts any other key too. llama.cpp's grammar generator reads
such an object as closed: only the listed keys, unless the schema says
`additionalProperties: true` or gives a schema for the extra values. A weak model given
the open reading keeps inventing keys until it runs out of tokens, so constrained output
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


def close_objects(schema: Any, *, closable: bool = True) -> Any:
    """A copy of `schema` where every object with `properties` and no word on
    `additionalProperties` gets `additionalProperties: false`.

    `allOf` members stay open (they are merged: closing one would forbid the keys of the
    others), and so does an object that combines its `properties` with an `allOf`.
    """
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _MAP and isinstance(value, Mapping):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [close_objects(sub, closable=False) for sub in value]
        elif key in _ONE or key in _LIST:
            out[key] = close_objects(value)
        else:
            out[key] = value
    if closable and _is_open_object(schema):
        out["additionalProperties"] = False
    return out


def _is_open_object(schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    is_object = kind is None or kind == "object" or (isinstance(kind, list) and "object" in kind)
    return (
        is_object
        and isinstance(schema.get("properties"), Mapping)
        and "additionalProperties" not in schema
        and "allOf" not in schema
    )
