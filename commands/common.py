"""Helpers shared by the subcommands: errors, settings, model loading with a spinner."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from mlxcel.config import ResolvedSettings
    from mlxcel.engine.distributed.group import Ranks
    from mlxcel.engine.loading.model import LoadedModel

#: Built-in defaults of the settings the subcommands' options set, as help shows them.
#: Written out so that `--help` need not import the settings model; a test keeps them equal
#: to `Settings`' defaults.
SETTING_DEFAULTS: dict[str, str] = {
    "n_predict": "-1",
    "threads": "-1",
    "cpu_dtype": "auto",
    "cache_type_k": "f16",
    "cache_type_v": "f16",
}

PROFILE_OPTION = typer.Option(
    None, "--profile", "-P", help="Settings profile: a name from configs/ or a TOML path."
)


def error_line(message: str) -> str:
    """`message` as the one stderr line of a failed command: `mlxcel: error: ...`."""
    first = message.strip().splitlines()[0] if message.strip() else "error"
    return f"mlxcel: error: {first}"


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line on stderr and exit with `code`."""
    print(error_line(message), file=sys.stderr)
    raise typer.Exit(code)


def stdin_text() -> str:
    """All of stdin as UTF-8 text, or one line and exit 2 when it is not UTF-8."""
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        fail("stdin is not UTF-8 text")


def utf8_text(value: str, what: str) -> str:
    """`value` as given on the command line, or one line and exit 2 when its bytes were not
    UTF-8 (Python keeps such bytes as lone surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"{what} is not UTF-8 text")
    return value


def resolve(profile: str | None, cli: dict[str, Any]) -> ResolvedSettings:
    """Settings from defaults < profile < env < the flags the user gave."""
    from mlxcel.config import SettingsError, resolve_settings

    try:
        return resolve_settings(
            profile=profile, cli={k: v for k, v in cli.items() if v is not None}
        )
    except SettingsError as exc:
        fail(str(exc))


def settings_actions(resolved: ResolvedSettings, show: bool, save: str | None) -> bool:
    """Handle `--show-settings` / `--save-profile`; True when the command should stop."""
    if save:
        from mlxcel.config import SettingsError, save_profile

        try:
            written = save_profile(resolved.settings, save)
        except OSError as exc:
            fail(f"cannot write {save}: {exc.strerror or exc}")
        except SettingsError as exc:  # a name that is no profile name ('my profile')
            fail(f"--save-profile: {exc}")
        print(f"mlxcel: settings written to {written}", file=sys.stderr)
    if show:
        from rich.console import Console

        from ._settings import print_settings

        print_settings(resolved, Console())
    return show or bool(save)


def load_model_or_exit(
    ref: str | None,
    *,
    store: str | None = None,
    quiet: bool = False,
    cpu_dtype: str = "keep",
    cpu_threads: int = -1,
    ranks: Ranks | None = None,
    pipeline: bool = False,
) -> LoadedModel:
    """Load a text model (this rank's shard of it in a group of `ranks`), or print one line
    and exit 2."""
    from functools import partial

    from rich.console import Console

    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.engine.loading import load_model

    console = Console(stderr=True)
    load = partial(
        load_model,
        ref,
        store_dir=store,
        cpu_dtype=cpu_dtype,
        cpu_threads=cpu_threads,
        ranks=ranks,
        pipeline=pipeline,
    )
    try:
        if quiet or not console.is_terminal:
            return load()
        with console.status(f"loading {ref or 'the default model'}…"):
            return load()
    except ModelLoadError as exc:
        fail(str(exc))
