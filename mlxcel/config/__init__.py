"""The settings layer: typed settings, TOML profiles, env vars and llama-server flags.

Settings resolve as built-in defaults < TOML profile < environment < command line; see
`resolve_settings`. This package knows nothing of MLX and stays cheap to import: the names
below load their module (pydantic with it) on first use, so `mlxcel.config.process_env`,
which the engine and the CLI read at import time, costs no more than itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.config.env import env_to_field, env_var, parse_text
    from mlxcel.config.llama_flags import (
        FLAGS,
        Flag,
        ServeArgs,
        Status,
        cli_label,
        flag_for_field,
        lookup,
        parse_serve_args,
        render_flags_markdown,
        serve_help,
    )
    from mlxcel.config.profiles import (
        Profile,
        find_profile,
        list_profiles,
        load_profile,
        save_profile,
        settings_to_toml,
        user_profile_dir,
    )
    from mlxcel.config.resolve import ResolvedSettings, resolve_settings
    from mlxcel.config.settings import (
        GROUPS,
        FieldMeta,
        Settings,
        SettingsError,
        all_field_meta,
        field_meta,
        field_names,
        parse_bool,
    )

_MODULES: dict[str, str] = {
    "env_to_field": "env",
    "env_var": "env",
    "parse_text": "env",
    "FLAGS": "llama_flags",
    "Flag": "llama_flags",
    "ServeArgs": "llama_flags",
    "Status": "llama_flags",
    "cli_label": "llama_flags",
    "flag_for_field": "llama_flags",
    "lookup": "llama_flags",
    "parse_serve_args": "llama_flags",
    "render_flags_markdown": "llama_flags",
    "serve_help": "llama_flags",
    "Profile": "profiles",
    "find_profile": "profiles",
    "list_profiles": "profiles",
    "load_profile": "profiles",
    "save_profile": "profiles",
    "settings_to_toml": "profiles",
    "user_profile_dir": "profiles",
    "ResolvedSettings": "resolve",
    "resolve_settings": "resolve",
    "GROUPS": "settings",
    "FieldMeta": "settings",
    "Settings": "settings",
    "SettingsError": "settings",
    "all_field_meta": "settings",
    "field_meta": "settings",
    "field_names": "settings",
    "parse_bool": "settings",
}


def __getattr__(name: str) -> Any:
    """Load the module that defines `name` on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "FLAGS",
    "GROUPS",
    "FieldMeta",
    "Flag",
    "Profile",
    "ResolvedSettings",
    "ServeArgs",
    "Settings",
    "SettingsError",
    "Status",
    "all_field_meta",
    "cli_label",
    "env_to_field",
    "env_var",
    "field_meta",
    "field_names",
    "find_profile",
    "flag_for_field",
    "list_profiles",
    "load_profile",
    "lookup",
    "parse_bool",
    "parse_serve_args",
    "parse_text",
    "render_flags_markdown",
    "resolve_settings",
    "save_profile",
    "serve_help",
    "settings_to_toml",
    "user_profile_dir",
]
