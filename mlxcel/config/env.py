"""Environment variables: which variable sets which field, and how text becomes a value.

Every settings field has exactly one variable (see `Settings` field metadata): llama-server's
`LLAMA_ARG_*` / `LLAMA_API_KEY` where llama-server has one, `MLXCEL_<FIELD>` otherwise.
Text parsing rules (shared with the `mlxcel serve` argv parser):

- booleans: 1/0, true/false, on/off, yes/no, enabled/disabled (any case);
- integers and numbers: Python's `int()` / `float()` syntax;
- `api_key`: comma-separated keys (or a JSON list);
- `dry_sequence_breaker`: one breaker, a JSON list of breakers, or `none` for no breakers;
- `chat_template_kwargs`: a JSON object;
- everything else: the text itself (choices are checked by the settings model).

An empty variable counts as unset.
"""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from mlxcel.config.settings import SettingsError, all_field_meta, field_meta, parse_bool


@functools.cache
def env_to_field() -> dict[str, str]:
    """Map of environment variable name to settings field."""
    return {meta.env: name for name, meta in all_field_meta().items()}


def env_var(field: str) -> str:
    """The environment variable of `field`."""
    return str(field_meta(field).env)


def _base_type(annotation: Any) -> Any:
    """The annotation with `None` removed from a union; Literal counts as str."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else annotation
    if origin is typing.Literal:
        return str
    return origin or annotation


def _json(raw: str, label: str, kind: type, what: str) -> Any:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{label}: expected {what}, got {raw!r} ({exc.msg})") from None
    if not isinstance(value, kind):
        raise SettingsError(f"{label}: expected {what}, got {raw!r}")
    return value


def _string_list(raw: str, label: str) -> list[str]:
    value = _json(raw, label, list, "a JSON list of strings")
    if not all(isinstance(v, str) for v in value):
        raise SettingsError(f"{label}: expected a JSON list of strings, got {raw!r}")
    return value


def is_text_field(field: str) -> bool:
    """True when `field` holds text (str, an optional str or a choice of strings)."""
    return _base_type(field_meta(field).annotation) is str


def parse_text(field: str, raw: str, *, label: str) -> Any:
    """Turn the text `raw` into a value for `field`; `label` names the source in errors."""
    meta = field_meta(field)
    kind = _base_type(meta.annotation)
    text = raw.strip()
    if kind is bool:
        flag = parse_bool(text)
        if flag is None:
            raise SettingsError(
                f"{label}: expected a boolean (1/0, true/false, on/off), got {raw!r}"
            )
        return flag
    if kind is int:
        try:
            return int(text, 10)
        except ValueError:
            raise SettingsError(f"{label}: expected an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise SettingsError(f"{label}: expected a number, got {raw!r}") from None
    if kind is dict:
        return _json(text, label, dict, "a JSON object")
    if kind is list:
        if text.startswith("["):
            return _string_list(text, label)
        if field == "dry_sequence_breaker":
            return [] if text.lower() == "none" else [raw]
        return [part.strip() for part in text.split(",") if part.strip()]
    return raw


def read_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The settings the environment gives: field -> (parsed value, variable name)."""
    out: dict[str, tuple[Any, str]] = {}
    for var, field in env_to_field().items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        out[field] = (parse_text(field, raw, label=var), var)
    return out
