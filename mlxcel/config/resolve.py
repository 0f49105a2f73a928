"""Resolve the effective settings: defaults < TOML profile < environment < command line.

Each layer is checked on its own, so a malformed value is reported against the place it
came from (`LLAMA_ARG_PORT: expected an integer, got 'abc'`, `profile x: temp: ...`, ...)
even when a higher layer overrides it. The result records, per field, which layer won:
`default`, `profile:NAME`, `env:VARNAME` or `cli`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.config.env import is_text_field, parse_text, read_env
from mlxcel.config.llama_flags import cli_label, env_warnings
from mlxcel.config.profiles import load_profile
from mlxcel.config.settings import Settings, SettingsError, all_field_meta, validate_values

PROFILE_ENV = "MLXCEL_PROFILE"


@dataclass
class ResolvedSettings:
    """The effective settings plus where each value came from."""

    settings: Settings
    sources: dict[str, str]
    profile: str | None = None
    profile_location: str | None = None
    warnings: list[str] = field(default_factory=list)

    def changed(self) -> dict[str, Any]:
        """Fields not at their built-in default source, with their values."""
        return {k: getattr(self.settings, k) for k, src in self.sources.items() if src != "default"}


def _cli_values(cli: Mapping[str, Any]) -> dict[str, Any]:
    meta = all_field_meta()
    out: dict[str, Any] = {}
    for key, value in cli.items():
        if value is None:
            continue
        if key in meta and isinstance(value, str) and not is_text_field(key):
            value = parse_text(key, value, label=cli_label(key))
        out[key] = value
    return validate_values(out, lambda key: cli_label(key) if key in meta else "cli")


def resolve_settings(
    *,
    profile: str | None = None,
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ResolvedSettings:
    """Merge defaults < profile (`profile`, else `$MLXCEL_PROFILE`) < env < `cli` values.

    `cli` holds only the values the user gave explicitly (field name -> value); `env`
    defaults to `os.environ`. Raises SettingsError (one line) on any bad input.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources = dict.fromkeys(all_field_meta(), "default")

    ref = profile or env.get(PROFILE_ENV) or None
    loaded = load_profile(ref, env) if ref else None
    if loaded is not None:
        values.update(loaded.values)
        sources.update(dict.fromkeys(loaded.values, f"profile:{loaded.name}"))

    from_env = read_env(env)
    env_values = validate_values(
        {k: v for k, (v, _) in from_env.items()}, lambda key: from_env[key][1]
    )
    values.update(env_values)
    sources.update({k: f"env:{from_env[k][1]}" for k in env_values})

    cli_values = _cli_values(cli or {})
    values.update(cli_values)
    sources.update(dict.fromkeys(cli_values, "cli"))

    try:
        settings = Settings.model_validate(values)
    except ValueError as exc:  # cross-field checks; per-field ones passed above
        raise SettingsError(f"settings: {exc}") from None
    _check_api_key_file(settings, sources)
    _check_text(settings, sources)
    return ResolvedSettings(
        settings=settings,
        sources=sources,
        profile=loaded.name if loaded else None,
        profile_location=loaded.location if loaded else None,
        warnings=env_warnings(env),
    )


def _check_text(settings: Settings, sources: dict[str, str]) -> None:
    """Every text setting must be UTF-8. Bytes on argv or in the environment that are not
    reach Python as lone surrogates, which no reply can carry: an `--alias` of them made
    every request a 500, an `--api-key` a traceback at start. A path too (a model's file
    name becomes its served name)."""
    for name, value in settings:
        texts = value if isinstance(value, (list, tuple)) else (value,)
        for text in texts:
            if not isinstance(text, str):
                continue
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                src = sources.get(name, "")
                where = src.removeprefix("env:") if src.startswith("env:") else cli_label(name)
                raise SettingsError(f"{where}: not UTF-8 text") from None


def _check_api_key_file(settings: Settings, sources: dict[str, str]) -> None:
    path = settings.api_key_file
    if not path:
        return
    src = sources["api_key_file"]
    where = src.removeprefix("env:") if src.startswith("env:") else cli_label("api_key_file")
    if not Path(path).expanduser().is_file():
        raise SettingsError(f"{where}: API key file not found: {path}")
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise SettingsError(f"{where}: cannot read API key file {path}: {reason}") from None
    if not text.strip():  # serving with no key at all is not what the flag asked for
        raise SettingsError(f"{where}: API key file {path} holds no key (one a line)")
