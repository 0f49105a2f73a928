"""Untrusted JSON schemas: the `response_format` wrapper rules and the size limits.

Everything here runs before a grammar engine sees the schema, so an oversized or malformed
schema costs a bounded amount of work and is refused with a short message that never
repeats the schema. Both errors are `InvalidRequestError`s (HTTP 400).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxcel.engine.errors import InvalidRequestError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_REFS = 64


class InvalidSchema(InvalidRequestError):
    """The schema is not usable: malformed, or rejected by the grammar engine (HTTP 400)."""


class SchemaTooLarge(InvalidSchema):
    """The schema is over a size, nesting or `$ref` limit (HTTP 400)."""


@dataclass(frozen=True)
class SchemaLimits:
    """Limits applied to a schema before compilation."""

    max_bytes: int = MAX_SCHEMA_BYTES  # of the compact UTF-8 serialization
    max_depth: int = MAX_SCHEMA_DEPTH  # JSON object/array nesting; `{}` is depth 1
    max_refs: int = MAX_SCHEMA_REFS  # `"$ref"` keys anywhere in the document


DEFAULT_LIMITS = SchemaLimits()


def canonical_schema(schema: Mapping[str, Any] | str, limits: SchemaLimits = DEFAULT_LIMITS) -> str:
    """Check `schema` against `limits` and return its compact JSON text (the cache key).

    A str is parsed as JSON first. Key order is kept: properties are generated in the order
    the schema lists them, so two schemas that differ only in key order are different
    grammars. Raises `SchemaTooLarge` or `InvalidSchema`.
    """
    if isinstance(schema, str):
        if len(schema.encode("utf-8")) > limits.max_bytes:
            raise _too_large(limits)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise InvalidSchema("response_format json_schema is not valid JSON") from None
    if not isinstance(schema, Mapping):
        raise InvalidSchema("response_format json_schema.schema must be a JSON object")
    depth, refs = _shape(schema, limits.max_depth)
    if depth > limits.max_depth:
        raise SchemaTooLarge(
            f"response_format json_schema nests more than {limits.max_depth} levels deep"
        )
    if refs > limits.max_refs:
        raise SchemaTooLarge(
            f"response_format json_schema has {refs} $ref entries; the limit is {limits.max_refs}"
        )
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        raise InvalidSchema("response_format json_schema is not valid JSON") from None
    if len(text.encode("utf-8")) > limits.max_bytes:
        raise _too_large(limits)
    return text


def _too_large(limits: SchemaLimits) -> SchemaTooLarge:
    return SchemaTooLarge(
        f"response_format json_schema is larger than {limits.max_bytes // 1024} KiB serialized"
    )


def _shape(document: Any, max_depth: int) -> tuple[int, int]:
    """(nesting depth, number of `$ref` keys) of a JSON document, without recursion.

    Stops descending once `max_depth` is exceeded (the answer is then `max_depth + 1`).
    """
    deepest = 0
    refs = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
            refs += sum(1 for key in node if key == "$ref")
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > max_depth:
            return deepest, refs
        stack.extend((child, depth + 1) for child in children)
    return deepest, refs


def schema_from_response_format(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a request's `response_format` asks for; None means unconstrained.

    `text` or unset: None. `json_schema`: `json_schema.schema` (`name` and `strict` are
    accepted and ignored). `json_object`: any JSON object (`JSON_OBJECT_SCHEMA`), as OpenAI
    and llama-server answer it, or llama-server's optional `schema` beside the type.
    Anything else: `InvalidRequestError`. The schema's limits are not checked here
    (`canonical_schema` does that).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError("response_format must be an object")
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_object_schema(response_format.get("schema"))
    if kind != "json_schema":
        raise InvalidRequestError(
            "response_format type must be 'text', 'json_object' or 'json_schema'"
            if not isinstance(kind, str) or len(kind) > 40
            else f"response_format type {kind!r} is not supported; "
            "use 'text', 'json_object' or 'json_schema'"
        )
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, Mapping):
        raise InvalidRequestError("response_format json_schema must be an object with a schema")
    schema = wrapper.get("schema")
    if schema is None:
        raise InvalidRequestError("response_format json_schema.schema is required")
    if not isinstance(schema, Mapping):
        raise InvalidSchema("response_format json_schema.schema must be a JSON object")
    return dict(schema)


JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
"""What `response_format: {"type": "json_object"}` constrains the output to: one JSON
object, any keys and values (whitespace bounded as for every grammar)."""


def _json_object_schema(schema: Any) -> dict[str, Any]:
    """The schema of a `json_object` format: `schema` when llama-server's extension gives
    one, else any object."""
    if schema is None:
        return dict(JSON_OBJECT_SCHEMA)
    if not isinstance(schema, Mapping):
        raise InvalidSchema("response_format json_object schema must be a JSON object")
    return dict(schema)
