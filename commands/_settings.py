"""CLI helpers for settings: show the resolved settings, report a settings error."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from mlxcel.config import ResolvedSettings

_SECRET_FIELDS = frozenset({"api_key"})


def _show(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name in _SECRET_FIELDS and value:
        return f"[{len(value)} key{'s' if len(value) != 1 else ''}]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def print_settings(resolved: ResolvedSettings, console: Console) -> None:
    """Print a table of every setting: key, value and where the value came from."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="mlxcel settings", title_justify="left")
    table.add_column("key", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", no_wrap=True)
    for name, source in resolved.sources.items():
        value = escape(_show(name, getattr(resolved.settings, name)))
        style = "dim" if source == "default" else "bold"
        table.add_row(name, value, f"[{style}]{escape(source)}[/{style}]")
    console.print(table)


def exit_with_settings_error(err: Exception) -> NoReturn:
    """Print `mlxcel: error: ...` (one line) on stderr and exit with status 2."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else type(err).__name__
    print(f"mlxcel: error: {line}", file=sys.stderr)
    raise typer.Exit(2)
