"""TOML settings profiles: find, load and save them.

A profile is a TOML file of settings. Keys are the `Settings` field names, either at the top
level (`temp = 0.2`) or inside the table of their group (`[sampling]` then `temp = 0.2`); the
groups are `[model]`, `[chat]`, `[sampling]`, `[server]` and `[logging]`. A key in the wrong
table, an unknown key or a malformed value is an error. Saving always writes the grouped form,
leaving out unset (None) values, so loading what was saved gives the same settings.

A profile reference is a path when it contains `/` or ends with `.toml`, otherwise a name,
looked up first among the user's profiles (`$MLXCEL_CONFIG_DIR/NAME.toml`, or
`${XDG_CONFIG_HOME:-~/.config}/mlxcel/profiles/NAME.toml`), then among the profiles shipped
in the `mlxcel.configs` package (the repository's `configs/` directory in a checkout).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.config.settings import (
    GROUPS,
    Settings,
    SettingsError,
    all_field_meta,
    validate_values,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SHIPPED_PACKAGE = "mlxcel.configs"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Profile:
    """A loaded profile: its reference, where it was found, and its checked values."""

    name: str
    location: str
    values: dict[str, Any]


def is_profile_path(ref: str) -> bool:
    """True when `ref` names a file rather than a profile name."""
    return "/" in ref or os.sep in ref or ref.endswith(".toml")


def user_profile_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the user's named profiles live."""
    env = os.environ if env is None else env
    if env.get("MLXCEL_CONFIG_DIR"):
        return Path(env["MLXCEL_CONFIG_DIR"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "mlxcel" / "profiles"


def shipped_profile_dir() -> Traversable:
    """The directory of the profiles that ship with mlxcel."""
    from importlib.resources import files

    try:
        return files(SHIPPED_PACKAGE)
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "configs"


def list_profiles(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every named profile -> where it is; the user's shadow shipped ones of the same name."""
    found: dict[str, str] = {}
    shipped = shipped_profile_dir()
    if shipped.is_dir():
        for item in sorted(shipped.iterdir(), key=lambda t: t.name):
            if item.name.endswith(".toml") and item.is_file():
                found[item.name[: -len(".toml")]] = str(item)
    user = user_profile_dir(env)
    if user.is_dir():
        for path in sorted(user.glob("*.toml")):
            found[path.stem] = str(path)
    return found


def find_profile(ref: str, env: Mapping[str, str] | None = None) -> Traversable:
    """Locate the profile `ref` (a name or a path); SettingsError when it does not exist."""
    if is_profile_path(ref):
        path = Path(ref).expanduser()
        if not path.is_file():
            raise SettingsError(f"profile file not found: {ref}")
        return path
    if not _NAME_RE.match(ref):
        raise SettingsError(f"invalid profile name {ref!r}")
    user = user_profile_dir(env) / f"{ref}.toml"
    if user.is_file():
        return user
    shipped = shipped_profile_dir() / f"{ref}.toml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(list_profiles(env))) or "none"
    raise SettingsError(f"unknown profile '{ref}' (known: {known})")


def parse_profile(text: str, name: str) -> dict[str, Any]:
    """Check profile TOML text; return its flat, typed values (field -> value)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"profile {name}: invalid TOML: {exc}") from None
    meta = all_field_meta()
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(key: str, value: Any, label: str) -> None:
        if key in flat:
            raise SettingsError(f"profile {name}: {label}: '{key}' is set twice")
        flat[key] = value
        where[key] = label

    for key, value in data.items():
        if key in GROUPS and isinstance(value, dict):
            for sub, sub_value in value.items():
                label = f"{key}.{sub}"
                if sub in meta and meta[sub].group != key:
                    raise SettingsError(
                        f"profile {name}: {label}: '{sub}' belongs in [{meta[sub].group}]"
                    )
                put(sub, sub_value, label)
        else:
            put(key, value, key)
    return validate_values(flat, lambda key: f"profile {name}: {where.get(key, key)}")


def load_profile(ref: str, env: Mapping[str, str] | None = None) -> Profile:
    """Find, read and check the profile `ref` (a name or a path)."""
    location = find_profile(ref, env)
    try:
        text = location.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"profile {ref}: cannot read {location}: {exc}") from None
    return Profile(name=ref, location=str(location), values=parse_profile(text, ref))


def settings_to_toml(settings: Settings, *, only_changed: bool = False) -> str:
    """The settings as grouped profile TOML; None values are left out."""
    import tomli_w

    meta = all_field_meta()
    tables: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for name, info in meta.items():
        value = getattr(settings, name)
        if value is None or (only_changed and value == info.default):
            continue
        tables[info.group][name] = value
    return tomli_w.dumps({group: table for group, table in tables.items() if table})


def save_profile(
    settings: Settings,
    path: str | os.PathLike[str],
    *,
    only_changed: bool = True,
    env: Mapping[str, str] | None = None,
) -> Path:
    """Write `settings` as a profile and return the file written.

    `path` is a file path, or a bare name saved into the user's profile directory.
    With `only_changed` (the default) only values that differ from the defaults are written.
    """
    ref = os.fspath(path)
    if is_profile_path(ref):
        target = Path(ref).expanduser()
    elif _NAME_RE.match(ref):
        target = user_profile_dir(env) / f"{ref}.toml"
    else:
        raise SettingsError(f"invalid profile name {ref!r}")
    header = "# mlxcel settings profile (see `mlxcel serve --help` for every key)\n"
    body = settings_to_toml(settings, only_changed=only_changed)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(header + ("\n" if body else "") + body, encoding="utf-8")
    return target
