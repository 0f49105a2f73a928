"""The settings layer: typed settings, TOML profiles, env vars and llama-server flags.

Settings resolve as built-in defaults < TOML profile < environment < command line; see
`resolve_settings`. This package knows nothing of MLX and stays cheap to import.
"""

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
