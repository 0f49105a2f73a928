"""`--models-preset FILE.ini`: one section per model, `[*]` for every model, as llama-server.

Keys are option names without their dashes (`ctx-size`, `c`, `no-jinja`), or their
environment variables (`LLAMA_ARG_CTX_SIZE`); values go through the `mlxcel serve` parser,
so a preset refuses what the command line refuses. Keys only a preset has: `load-on-startup`
(load the model when the server starts), `stop-timeout` (seconds an unload waits for the
model's requests, default 10) and `pin` (never unloaded to make room for another model).
`model` names the model of a section that is not in `--models-dir`; `alias` adds names.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.config.llama_flags import FLAGS, Flag, lookup, parse_serve_args
from mlxcel.config.settings import SettingsError, parse_bool

GLOBAL_SECTION = "*"
DEFAULT_STOP_TIMEOUT = 10.0

ROUTER_FIELDS = frozenset(
    {
        "host",
        "port",
        "api_key",
        "api_key_file",
        "api_prefix",
        "models_dir",
        "models_preset",
        "models_max",
        "models_autoload",
        "ssl_key_file",
        "ssl_cert_file",
        "metrics_port",
        "max_connections",
    }
)
"""Fields the router owns: a preset cannot set them per model (llama-server drops them too)."""

_TOP = "__top__"  # the keys before the first section (only `version` belongs there)


@dataclass
class PresetSection:
    """One section: the settings it sets and the router's own keys."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)  # settings field -> value
    args: list[str] = field(default_factory=list)  # the same as command-line flags
    load_on_startup: bool | None = None
    stop_timeout: float | None = None
    pinned: bool | None = None


@dataclass
class Preset:
    """A parsed preset file: `[*]` and the model sections, in file order."""

    defaults: PresetSection
    sections: list[PresetSection]
    warnings: list[str] = field(default_factory=list)


def read_preset(path: str | Path) -> Preset:
    """Parse the preset at `path` (SettingsError, one line naming the section and key)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"--models-preset: cannot read {path}: {exc.strerror or exc}") from None
    parser = configparser.ConfigParser(
        interpolation=None,
        strict=False,
        default_section="__none__",
        delimiters=("=",),
        inline_comment_prefixes=(";", "#"),
    )
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keep LLAMA_ARG_* case
    try:
        parser.read_string(f"[{_TOP}]\n{text}", source=str(path))
    except configparser.Error as exc:
        first = str(exc).splitlines()[0]
        raise SettingsError(f"--models-preset: {path.name}: {first}") from None
    warnings: list[str] = []
    defaults = PresetSection(GLOBAL_SECTION)
    sections: list[PresetSection] = []
    for name in parser.sections():
        items = dict(parser.items(name))
        if name == _TOP:
            items.pop("version", None)
            if items:
                raise SettingsError(
                    f"--models-preset: {path.name}: {', '.join(items)} before the first section "
                    "(put options for every model under [*])"
                )
            continue
        section = _section(name, items, warnings)
        if name == GLOBAL_SECTION:
            defaults = section
        else:
            sections.append(section)
    return Preset(defaults, sections, warnings)


def _section(name: str, items: dict[str, str], warnings: list[str]) -> PresetSection:
    section = PresetSection(name)
    argv: list[str] = []
    for key, raw in items.items():
        value = raw.strip()
        where = f"--models-preset [{name}] {key}"
        if key == "load-on-startup":
            section.load_on_startup = _bool(value, where)
        elif key == "stop-timeout":
            section.stop_timeout = _seconds(value, where)
        elif key == "pin":
            section.pinned = _bool(value, where)
        else:
            argv += _flag_args(key, value, where)
    try:
        parsed = parse_serve_args(argv)
    except SettingsError as exc:
        raise SettingsError(f"--models-preset [{name}]: {exc}") from None
    warnings += [f"--models-preset [{name}]: {line}" for line in parsed.warnings]
    for key in sorted(ROUTER_FIELDS & set(parsed.cli)):
        warnings.append(f"--models-preset [{name}]: ignoring {key}: the router sets it")
        parsed.cli.pop(key)
    section.options = parsed.cli
    section.args = argv
    return section


def _flag_args(key: str, value: str, where: str) -> list[str]:
    """`key = value` as the command-line words it stands for."""
    flag, spelling = _flag_for_key(key)
    if flag is None:
        raise SettingsError(f"{where}: unknown option")
    if flag.nargs and not flag.optional:
        return [spelling, value]
    if flag.optional:
        return [spelling, value] if value else [spelling]
    on = _bool(value, where)
    negative = spelling in flag.negatives
    if on != negative:  # `jinja = true`, `no-jinja = false`: the positive spelling
        return [spelling if not negative else flag.name]
    negatives = sorted(flag.negatives)
    if negative:
        return [spelling]
    return [negatives[0]] if negatives else []


def _flag_for_key(key: str) -> tuple[Flag | None, str]:
    for spelling in (f"--{key}", f"-{key}"):
        flag = lookup(spelling)
        if flag is not None:
            return flag, spelling
    for flag in FLAGS:
        if key in (flag.env, flag.tsv_env) and key:
            return flag, flag.name
    return None, key


def _bool(value: str, where: str) -> bool:
    parsed = parse_bool(value)
    if parsed is None:
        raise SettingsError(f"{where}: expected true or false, got {value!r}")
    return parsed


def _seconds(value: str, where: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise SettingsError(f"{where}: expected seconds (0 or more), got {value!r}")
    return seconds
