"""Bi-encoder reranking: embed the query and each document, score by cosine similarity."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from mlxcel.engine.embeddings.embedder import Embedder, Vector
from mlxcel.engine.embeddings.normalize import normalize
from mlxcel.engine.embeddings.rerank import Reranker, RerankOutput, RerankPlan
from mlxcel.engine.embeddings.tokenization import TokenizedInput


class BiEncoderReranker(Reranker):
    """Ranks with any embedding model; the plan's first sequence is the query."""

    kind = "bi-encoder"

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.name = embedder.name
        self.path = embedder.path
        self.pooling = embedder.default_pooling if embedder.default_pooling != "none" else "mean"

    @property  # type: ignore[override]
    def max_length(self) -> int:
        """The embedder's input limit (one value for both uses)."""
        return self.embedder.max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        self.embedder.max_length = value

    @property
    def forward_key(self) -> Hashable:
        # The same key as embedding jobs: rerank and embedding sequences share batches.
        return ("embed", id(self.embedder), self.pooling)

    def prepare(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> RerankPlan:
        items = self.embedder.tokenize([query, *documents], truncate=truncate)
        return RerankPlan(items=items, documents=len(documents))

    def forward(self, batch: Sequence[TokenizedInput]) -> list[Vector]:
        return self.embedder.forward(batch, self.pooling)

    def finish(self, plan: RerankPlan, outputs: list[Any]) -> RerankOutput:
        unit = normalize(np.stack(outputs), 2)
        cosines = [float(x) for x in unit[1:] @ unit[0]]
        items: list[TokenizedInput] = plan.items
        return RerankOutput(
            scores=cosines,
            relevance=list(cosines),
            token_counts=[len(x) for x in items[1:]],
            truncated=[x.truncated for x in items[1:]],
            query_tokens=len(items[0]),
        )
