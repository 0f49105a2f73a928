"""Embed texts with an embedding model (default: the shipped all-MiniLM-L6-v2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .common import PROFILE_OPTION, fail, resolve, stdin_text, utf8_text

if TYPE_CHECKING:
    from mlxcel.engine.embeddings import Embedder, EmbeddingOutput

PREVIEW_VALUES = 4
PREVIEW_TEXT = 48


def read_lines(path: str) -> list[str]:
    """Non-blank lines of `path` (`-` is stdin), one input per line."""
    try:
        text = stdin_text() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{path} is not UTF-8 text")
    return [line.strip() for line in text.splitlines() if line.strip()]


def gather_texts(texts: list[str] | None, file: str | None) -> list[str]:
    """TEXT arguments (`-` reads stdin, one text per line) followed by the lines of --file."""
    out: list[str] = []
    for text in texts or []:
        out.extend(read_lines("-") if text == "-" else [utf8_text(text, "an argument")])
    if file is not None:
        out.extend(read_lines(file))
    return out


def with_spinner(message: str, quiet: bool, load: Any) -> Any:
    from rich.console import Console

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        return load()
    with console.status(message):
        return load()


def load_embedder_or_exit(ref: str | None, pooling: str | None, quiet: bool) -> Embedder:
    """Load an embedding model, or print one line and exit 2."""
    from mlxcel.engine.embeddings import load_embedder
    from mlxcel.engine.errors import EngineError

    try:
        return with_spinner(  # type: ignore[no-any-return]
            f"loading {ref or 'the default embedding model'}…",
            quiet,
            lambda: load_embedder(ref, pooling=pooling),
        )
    except EngineError as exc:
        fail(str(exc))


def preview_text(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= PREVIEW_TEXT else flat[: PREVIEW_TEXT - 1] + "…"


def _vector_preview(vector: Any) -> str:
    flat = vector.reshape(-1)
    shown = ", ".join(f"{x:+.4f}" for x in flat[:PREVIEW_VALUES])
    return f"[{shown}{', …' if flat.size > PREVIEW_VALUES else ''}]"


def print_table(embedder: Embedder, texts: list[str], output: EmbeddingOutput) -> None:
    """The default view: model facts, then one row per input with a vector preview."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"model [bold]{embedder.name}[/]  dimension [bold]{output.vectors[0].shape[-1]}[/]  "
        f"pooling {output.pooling}  normalize {output.normalize}"
    )
    table = Table(show_edge=False)
    table.add_column("#", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("text")
    table.add_column("embedding")
    for i, (text, vector) in enumerate(zip(texts, output.vectors, strict=True)):
        tokens = f"{output.token_counts[i]}{' (cut)' if output.truncated[i] else ''}"
        shape = f"{vector.shape[0]}×" if vector.ndim == 2 else ""
        table.add_row(str(i), tokens, preview_text(text), shape + _vector_preview(vector))
    console.print(table)
    if len(texts) == 2 and output.pooling != "none":
        a, b = (np.asarray(v, dtype=np.float64) for v in output.vectors)
        denom = float(np.linalg.norm(a) * np.linalg.norm(b)) or 1.0
        console.print(f"cosine(0, 1) = {float(a @ b) / denom:.4f}")


def embed(
    texts: list[str] | None = typer.Argument(
        None, help="Texts to embed; - reads stdin, one text per line."
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Embedding model dir or HF repo id; default: all-MiniLM-L6-v2."
    ),
    file: str | None = typer.Option(None, "--file", "-f", help="File with one text per line."),
    pooling: str | None = typer.Option(
        None, "--pooling", help="none, mean, cls or last; default: the model's."
    ),
    normalize: int | None = typer.Option(
        None,
        "--normalize",
        "--embd-normalize",
        help="-1 none, 0 max-abs (int16), 1 taxicab, 2 euclidean (default), >2 p-norm.",
    ),
    no_truncate: bool = typer.Option(
        False, "--no-truncate", help="Fail on inputs over the model's limit instead of cutting."
    ),
    dimensions: int | None = typer.Option(
        None, "--dimensions", help="Keep only the first N dimensions (then normalize)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the vectors as JSON."),
    npy: str | None = typer.Option(None, "--npy", help="Write the (N, D) float32 matrix here."),
    profile: str | None = PROFILE_OPTION,
) -> None:
    """Embed texts and show the dimension and a preview of each vector."""
    if as_json and npy:
        fail("--json and --npy cannot be used together")
    if pooling is not None and pooling not in ("none", "mean", "cls", "last"):
        fail(f"--pooling must be none, mean, cls or last, not {pooling!r}")
    if normalize is not None and normalize < -1:
        fail(f"--normalize must be -1 or more, not {normalize}")
    settings = resolve(profile, {}).settings
    inputs = gather_texts(texts, file)
    if not inputs:
        fail("no text given (pass TEXT..., - for stdin, or --file FILE)")
    ref = model or getattr(settings, "embedding_model", None)
    mode = settings.embd_normalize if normalize is None else normalize
    method = pooling or (settings.pooling if settings.pooling not in (None, "rank") else None)
    embedder = load_embedder_or_exit(ref, method, quiet=as_json or bool(npy))

    from mlxcel.engine.errors import EngineError

    try:
        output = embedder.embed(
            inputs, normalize=mode, truncate=not no_truncate, dimensions=dimensions
        )
    except EngineError as exc:
        fail(str(exc))
    if npy:
        _write_npy(npy, output)
        return
    if as_json:
        print(json.dumps(_json_payload(embedder, inputs, output), ensure_ascii=False))
        return
    print_table(embedder, inputs, output)


def _json_payload(embedder: Embedder, texts: list[str], output: EmbeddingOutput) -> dict[str, Any]:
    return {
        "model": embedder.name,
        "dimension": int(output.vectors[0].shape[-1]),
        "pooling": output.pooling,
        "normalize": output.normalize,
        "data": [
            {
                "index": i,
                "text": text,
                "tokens": output.token_counts[i],
                "truncated": output.truncated[i],
                "embedding": output.vectors[i].tolist(),
            }
            for i, text in enumerate(texts)
        ],
    }


def _write_npy(path: str, output: EmbeddingOutput) -> None:
    import numpy as np

    if output.pooling == "none":
        if len(output.vectors) != 1:
            fail("--npy with pooling none takes a single text (one (tokens, D) matrix)")
        matrix = output.vectors[0]
    else:
        matrix = output.matrix()
    try:
        # Through a file object: np.save given a name adds `.npy` to one without it.
        with open(path, "wb") as out:
            np.save(out, matrix.astype(np.float32))
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    rows, dims = matrix.shape
    print(f"mlxcel: wrote {rows}×{dims} float32 to {path}", file=sys.stderr)
