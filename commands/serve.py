"""Serve a model over HTTP: a drop-in llama-server (OpenAI and llama.cpp routes)."""

from __future__ import annotations

import sys

import typer

from .common import fail

CONTEXT_SETTINGS = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": [],
}
"""Click settings the command is registered with: every argument goes to our own parser."""

HELP_FLAGS = ("-h", "--help", "--usage")


def serve(ctx: typer.Context) -> None:
    """Serve a model over HTTP: a drop-in llama-server (run `mlxcel serve --help`)."""
    argv = list(ctx.args)
    from mlxcel.config import SettingsError, parse_serve_args, resolve_settings, serve_help

    if any(arg in HELP_FLAGS for arg in argv):
        sys.stdout.write(serve_help())
        return
    try:
        parsed = parse_serve_args(argv)
    except SettingsError as exc:
        fail(str(exc))
    if parsed.action == "help":
        sys.stdout.write(serve_help())
        return
    if parsed.action == "version":
        from mlxcel import __version__

        print(f"mlxcel {__version__}")
        return
    for line in parsed.warnings:
        print(f"mlxcel: warning: {line}", file=sys.stderr)
    try:
        resolved = resolve_settings(profile=parsed.profile, cli=parsed.cli)
    except SettingsError as exc:
        fail(str(exc))
    for line in resolved.warnings:
        print(f"mlxcel: warning: {line}", file=sys.stderr)

    from mlxcel.server.runner import run_server

    try:
        cli_fields = [name for name, source in resolved.sources.items() if source == "cli"]
        code = run_server(resolved.settings, cli_fields)
    except SettingsError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        code = 130
    if code:
        raise typer.Exit(code)
