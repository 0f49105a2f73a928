"""The `mlxcel` Typer app: one subcommand per capability (`mlxcel.cli.main` runs it).

Importing this module must stay cheap (no ML libraries): `mlxcel --help` and shell
completion load nothing heavy; each subcommand imports the engine when it runs.
"""

from __future__ import annotations

import typer

from mlxcel import __version__
from mlxcel.commands import (
    bench,
    cache,
    embed,
    generate,
    image,
    rerank,
    serve,
    speak,
    tokenize,
    transcribe,
)


def _hide_switch_metavars() -> None:
    """Help shows no `<bool>` value for plain switches (`--ignore-eos`): they take none."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        if self.is_flag and not self.count:
            return None
        return shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign,assignment]


_hide_switch_metavars()

app = typer.Typer(
    name="mlxcel",
    help="Local inference on MLX: generate, tokenize, manage models.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlxcel {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Local inference on MLX."""


app.command("generate", help=generate.__doc__)(generate.generate)
app.command("tokenize", help=tokenize.__doc__)(tokenize.tokenize)
app.command("embed", help=embed.__doc__)(embed.embed)
app.command("rerank", help=rerank.__doc__)(rerank.rerank)
app.command("transcribe", help=transcribe.__doc__)(transcribe.transcribe)
app.command("speak", help=speak.__doc__)(speak.speak)
app.command("image", help=image.__doc__)(image.image)
app.add_typer(cache.app, name="cache")
app.add_typer(bench.app, name="bench")
app.command("serve", help=serve.__doc__, context_settings=serve.CONTEXT_SETTINGS)(serve.serve)
