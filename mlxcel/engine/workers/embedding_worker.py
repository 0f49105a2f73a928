"""The embedding/rerank worker: one thread per model, serving both kinds of job."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from mlxcel.engine.embeddings.embedder import Embedder, EmbeddingOutput, finish_vector
from mlxcel.engine.embeddings.normalize import check_normalize
from mlxcel.engine.embeddings.rerank import (
    Reranker,
    RerankOutput,
    RerankPlan,
    check_rerank_request,
)
from mlxcel.engine.embeddings.tokenization import EmbeddingInput, TokenizedInput
from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.workers.batch_worker import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_QUEUE_DEPTH,
    BatchItem,
    BatchWorker,
)


class _EmbedTask:
    """Tokenize on the worker, then normalize and cut the pooled vectors."""

    def __init__(
        self,
        embedder: Embedder,
        inputs: Sequence[EmbeddingInput],
        pooling: Any,
        normalize: int,
        truncate: bool,
        dimensions: int | None,
    ) -> None:
        self.embedder = embedder
        self.inputs = list(inputs)
        self.pooling = pooling
        self.normalize = normalize
        self.truncate = truncate
        self.dimensions = dimensions
        self.tokens: list[TokenizedInput] = []

    def prepare(self) -> list[TokenizedInput]:
        self.tokens = self.embedder.tokenize(self.inputs, truncate=self.truncate)
        return self.tokens

    def forward(self, batch: Sequence[TokenizedInput]) -> list[Any]:
        return self.embedder.forward(batch, self.pooling)

    def finish(self, outputs: list[Any]) -> EmbeddingOutput:
        return EmbeddingOutput(
            vectors=[
                finish_vector(v, self.pooling, self.normalize, self.dimensions) for v in outputs
            ],
            token_counts=[len(t) for t in self.tokens],
            truncated=[t.truncated for t in self.tokens],
            pooling=self.pooling,
            normalize=self.normalize,
        )


class _RerankTask:
    def __init__(
        self,
        reranker: Reranker,
        query: str,
        documents: Sequence[str],
        truncate: bool,
        instruction: str | None,
    ) -> None:
        self.reranker = reranker
        self.query = query
        self.documents = list(documents)
        self.truncate = truncate
        self.instruction = instruction
        self.plan: RerankPlan | None = None

    def prepare(self) -> list[Any]:
        self.plan = self.reranker.prepare(
            self.query, self.documents, truncate=self.truncate, instruction=self.instruction
        )
        return self.plan.items

    def finish(self, outputs: list[Any]) -> RerankOutput:
        assert self.plan is not None
        return self.reranker.finish(self.plan, outputs)


class EmbeddingWorker:
    """Embeddings and/or reranking on one worker thread.

    `embed` and `rerank` validate what they can at once (raising InvalidRequestError),
    queue the job (QueueFullError when full) and return a Future of the output.
    """

    def __init__(
        self,
        *,
        embedder: Embedder | None = None,
        reranker: Reranker | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        timeout: float | None = None,
        name: str | None = None,
    ) -> None:
        if embedder is None and reranker is None:
            raise ValueError("a worker needs an embedder or a reranker")
        self.embedder = embedder
        self.reranker = reranker
        self.timeout = timeout if timeout and timeout > 0 else None
        model = embedder.name if embedder is not None else reranker.name  # type: ignore[union-attr]
        self.worker = BatchWorker(
            name or f"mlxcel-embed[{model}]", batch_size=batch_size, queue_depth=queue_depth
        )

    def start(self) -> EmbeddingWorker:
        """Start the thread."""
        self.worker.start()
        return self

    def stop(self) -> None:
        """Stop the thread; queued jobs fail."""
        self.worker.stop()

    def _deadline(self) -> float | None:
        return time.monotonic() + self.timeout if self.timeout else None

    def embed(
        self,
        inputs: Sequence[EmbeddingInput],
        *,
        pooling: str | None = None,
        normalize: int = 2,
        truncate: bool = True,
        dimensions: int | None = None,
    ) -> Future[EmbeddingOutput]:
        """Queue an embedding job."""
        if self.embedder is None:
            raise InvalidRequestError("this worker does not serve embeddings")
        if not inputs:
            raise InvalidRequestError("no input to embed")
        try:
            check_normalize(normalize)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        method = self.embedder.resolve_pooling(pooling)
        if (
            dimensions is not None
            and method != "none"
            and not 0 < dimensions <= self.embedder.dimension
        ):
            raise InvalidRequestError(
                f"dimensions must be between 1 and {self.embedder.dimension} for this model, "
                f"got {dimensions}"
            )
        task = _EmbedTask(self.embedder, inputs, method, normalize, truncate, dimensions)
        job = BatchItem(
            prepare=task.prepare,
            forward=task.forward,
            finish=task.finish,
            key=("embed", id(self.embedder), method),
            size=len(task.inputs),
            deadline=self._deadline(),
        )
        return self.worker.submit(job)

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> Future[RerankOutput]:
        """Queue a rerank job."""
        if self.reranker is None:
            raise InvalidRequestError("this worker does not serve reranking")
        check_rerank_request(query, documents)
        task = _RerankTask(self.reranker, query, documents, truncate, instruction)
        job = BatchItem(
            prepare=task.prepare,
            forward=self.reranker.forward,
            finish=task.finish,
            key=self.reranker.forward_key,
            size=len(task.documents) + 1,
            deadline=self._deadline(),
        )
        return self.worker.submit(job)
