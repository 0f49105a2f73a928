"""Rank documents against a query with a reranker (default: MiniLM by cosine)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

from .common import PROFILE_OPTION, fail, resolve, utf8_text
from .embed import gather_texts, preview_text, with_spinner

if TYPE_CHECKING:
    from mlxcel.engine.embeddings import Reranker, RerankOutput


def load_reranker_or_exit(ref: str | None, quiet: bool) -> Reranker:
    """Load a reranker, or print one line and exit 2."""
    from mlxcel.engine.embeddings import load_reranker
    from mlxcel.engine.errors import EngineError

    try:
        return with_spinner(  # type: ignore[no-any-return]
            f"loading {ref or 'the default reranker'}…", quiet, lambda: load_reranker(ref)
        )
    except EngineError as exc:
        fail(str(exc))


def print_ranking(
    reranker: Reranker, docs: list[str], output: RerankOutput, top: list[int]
) -> None:
    """A ranked table: rank, document index, relevance, raw score, text preview."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"model [bold]{reranker.name}[/] ({reranker.kind})")
    table = Table(show_edge=False)
    table.add_column("rank", justify="right")
    table.add_column("doc", justify="right")
    table.add_column("relevance", justify="right")
    table.add_column("score", justify="right")
    table.add_column("document")
    for rank, i in enumerate(top, start=1):
        cut = " (cut)" if output.truncated[i] else ""
        table.add_row(
            str(rank),
            str(i),
            f"{output.relevance[i]:.4f}",
            f"{output.scores[i]:+.4f}",
            preview_text(docs[i]) + cut,
        )
    console.print(table)


def rerank(
    documents: list[str] | None = typer.Argument(
        None, help="Documents to rank; - reads stdin, one per line."
    ),
    query: str = typer.Option(..., "--query", "-q", help="The query to rank documents against."),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Cross-encoder, yes/no reranker or embedding model; default: all-MiniLM-L6-v2.",
    ),
    file: str | None = typer.Option(None, "--file", "-f", help="File with one document per line."),
    top_n: int | None = typer.Option(None, "--top-n", "-n", help="Show only the best N."),
    instruction: str | None = typer.Option(
        None, "--instruction", help="Task line for generative (Qwen3-Reranker style) models."
    ),
    no_truncate: bool = typer.Option(
        False, "--no-truncate", help="Fail on documents over the model's limit instead of cutting."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the ranking as JSON."),
    profile: str | None = PROFILE_OPTION,
) -> None:
    """Rank documents by relevance to a query and print them best first."""
    if top_n is not None and top_n < 1:
        fail(f"--top-n must be at least 1, not {top_n}")
    if not utf8_text(query, "the query"):
        fail("the query is empty")
    settings = resolve(profile, {}).settings
    docs = gather_texts(documents, file)
    if not docs:
        fail("no documents given (pass DOC..., - for stdin, or --file FILE)")
    ref = model or getattr(settings, "reranker_model", None)
    reranker = load_reranker_or_exit(ref, quiet=as_json)

    from mlxcel.engine.errors import EngineError

    try:
        output = reranker.rerank(query, docs, truncate=not no_truncate, instruction=instruction)
    except EngineError as exc:
        fail(str(exc))
    order = output.ranking()
    top = order[:top_n] if top_n is not None else order
    if as_json:
        print(json.dumps(_json_payload(reranker, query, docs, output, top), ensure_ascii=False))
        return
    print_ranking(reranker, docs, output, top)


def _json_payload(
    reranker: Reranker, query: str, docs: list[str], output: RerankOutput, top: list[int]
) -> dict[str, Any]:
    return {
        "model": reranker.name,
        "kind": reranker.kind,
        "query": query,
        "results": [
            {
                "index": i,
                "relevance_score": output.relevance[i],
                "score": output.scores[i],
                "truncated": output.truncated[i],
                "document": docs[i],
            }
            for i in top
        ],
        "usage": {"prompt_tokens": output.prompt_tokens},
    }
