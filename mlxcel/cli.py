"""The `mlxcel` console script: run the app, usage errors and Ctrl-C as the CLI reports them.

This module imports nothing at its top, so a Ctrl-C while Python loads the app (Typer, rich,
the subcommands) ends as any other: exit 130, no traceback.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer


def _usage_error(exc: typer.TyperException) -> str:
    """A usage error (a bad flag value, an unknown option, a missing argument) as one stderr
    line; Typer's own report is a usage line, a hint and a framed box."""
    from mlxcel.commands.common import error_line

    text = exc.format_message()
    text = text[:1].lower() + text[1:].rstrip(".")
    path = getattr(getattr(exc, "ctx", None), "command_path", None)
    return error_line(f"{text} (see `{path} -h`)" if path else text)


def main() -> None:
    """Console-script entry point."""
    # transformers (imported by mlx-lm and the tokenizer loaders) prints an advisory line,
    # "PyTorch was not found...", on every start without torch, which mlxcel never needs.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import typer

        from mlxcel.app import app
        from mlxcel.commands.common import error_line
    except KeyboardInterrupt:  # the app's own run turns Ctrl-C into exit 130 likewise
        sys.exit(130)
    try:
        code = app(standalone_mode=False, prog_name="mlxcel")
    except typer.TyperException as exc:
        # A bare `mlxcel` or `mlxcel cache` has printed its help already.
        if type(exc).__name__ != "NoArgsIsHelpError":
            print(_usage_error(exc), file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:  # stdin ended at a confirmation prompt
        print(error_line("aborted"), file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
