"""Turn rerank requests into worker jobs and scores into the Jina/Cohere or TEI shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mlxcel.server.bridge import await_engine
from mlxcel.server.embeddings.serving import DEFAULT_MAX_INPUTS, DEFAULT_TIMEOUT_SECONDS

if TYPE_CHECKING:
    from mlxcel.engine.embeddings.rerank import RerankOutput
    from mlxcel.engine.workers.embedding_worker import EmbeddingWorker


class RerankService:
    """Reranking over one worker."""

    def __init__(
        self,
        worker: EmbeddingWorker,
        *,
        model_name: str,
        max_inputs: int = DEFAULT_MAX_INPUTS,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        if worker.reranker is None:
            raise ValueError("the worker has no reranking model")
        self.worker = worker
        self.reranker = worker.reranker
        self.model_name = model_name
        self.max_inputs = max_inputs
        self.timeout = timeout if timeout and timeout > 0 else None

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> RerankOutput:
        """Score `documents` against `query` on the worker."""
        return await await_engine(
            lambda: self.worker.rerank(
                query, list(documents), truncate=truncate, instruction=instruction
            ),
            self.timeout,
        )


def _ranked(output: RerankOutput, top_n: int | None) -> list[int]:
    order = output.ranking()
    return order[:top_n] if top_n is not None else order


def jina_response(
    output: RerankOutput,
    documents: Sequence[str],
    *,
    model: str,
    top_n: int | None = None,
    return_documents: bool = False,
) -> dict[str, Any]:
    """The Jina/Cohere object: `results` best first, `relevance_score` in [0, 1] for logit
    models (the sigmoid of the raw score) and the cosine for embedding models."""
    results = []
    for i in _ranked(output, top_n):
        item: dict[str, Any] = {"index": i, "relevance_score": output.relevance[i]}
        if return_documents:
            item["document"] = {"text": documents[i]}
        if output.truncated[i]:
            item["truncated"] = True
        results.append(item)
    tokens = output.prompt_tokens
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


def tei_response(
    output: RerankOutput,
    texts: Sequence[str],
    *,
    top_n: int | None = None,
    raw_scores: bool = False,
    return_text: bool = False,
) -> list[dict[str, Any]]:
    """The TEI array `[{index, score}]`, best first; `raw_scores` skips the sigmoid."""
    out = []
    for i in _ranked(output, top_n):
        score = output.scores[i] if raw_scores else output.relevance[i]
        item: dict[str, Any] = {"index": i, "score": score}
        if return_text:
            item["text"] = texts[i]
        if output.truncated[i]:
            item["truncated"] = True
        out.append(item)
    return out
