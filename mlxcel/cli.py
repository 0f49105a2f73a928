"""The `mlxcel` console script: run the app, usage errors and Ctrl-C as the CLI reports them.

This module imports nothing at its top, so a Ctrl-C while Python loads the app (Typer, rich,
the subcommands) ends as any other: exit 130, no traceback.
"""

from __future__ import annotations

import contextlib
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


def _discard_stdout() -> None:
    """Close a stdout whose write failed (its buffer with it: exit would try it again)."""
    failed, sys.stdout = sys.stdout, open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    with contextlib.suppress(OSError):
        failed.close()


def main() -> None:
    """Console-script entry point."""
    # transformers (imported by mlx-lm and the tokenizer loaders) prints an advisory line,
    # "PyTorch was not found...", on every start without torch, which mlxcel never needs.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in ("stdout", "stderr"):  # a closed descriptor (`>&-`): write into nothing,
        if getattr(sys, name) is None:  # as print() does; generate's writes failed on None
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115
    try:
        import typer

        from mlxcel.app import app
        from mlxcel.commands.common import error_line
    except KeyboardInterrupt:  # the app's own run turns Ctrl-C into exit 130 likewise
        sys.exit(130)
    try:
        code = app(standalone_mode=False, prog_name="mlxcel")
        sys.stdout.flush()  # here, not at exit, where a failure is Python's own report
    except OSError as exc:  # the output cannot be written (a full disk), or another file
        _discard_stdout()
        reason = exc.strerror or str(exc)
        print(error_line(f"{exc.filename}: {reason}" if exc.filename else reason), file=sys.stderr)
        sys.exit(1)
    except typer.TyperException as exc:
        # A bare `mlxcel` or `mlxcel cache` has printed its help already.
        if type(exc).__name__ != "NoArgsIsHelpError":
            print(_usage_error(exc), file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:  # stdin ended at a confirmation prompt
        print(error_line("aborted"), file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
