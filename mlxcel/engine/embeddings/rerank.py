"""The reranker interface: score documents against a query, in document order."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.embeddings.embedder import DEFAULT_BATCH_SIZE, plan_batches
from mlxcel.engine.errors import InvalidRequestError


def sigmoid(x: float) -> float:
    """The logistic function, safe for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


@dataclass
class RerankOutput:
    """Scores of each document, in document order.

    `scores` are the model's raw scores (logits, log-odds, or cosines); `relevance` maps them
    to [0, 1] for logit models (the sigmoid) and keeps cosines as they are.
    """

    scores: list[float]
    relevance: list[float]
    token_counts: list[int]
    truncated: list[bool]
    query_tokens: int = 0  # tokens read once for the query (bi-encoders)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the model read for the request (after truncation)."""
        return sum(self.token_counts) + self.query_tokens

    def ranking(self) -> list[int]:
        """Document indices, best first (ties keep document order)."""
        return sorted(range(len(self.scores)), key=lambda i: (-self.scores[i], i))


@dataclass(frozen=True)
class RerankPlan:
    """What a rerank request becomes before the model runs: sequences and how to score them."""

    items: list[Any]  # sized token sequences, passed to `Reranker.forward` in batches
    documents: int


class Reranker(ABC):
    """A reranking model: turn (query, documents) into sequences, run them, score them."""

    name: str
    path: Path
    kind: str  # "cross-encoder" | "generative" | "bi-encoder"
    max_length: int

    @abstractmethod
    def prepare(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> RerankPlan:
        """Tokenize the request into model sequences (may raise InvalidRequestError)."""

    @abstractmethod
    def forward(self, batch: Sequence[Any]) -> list[Any]:
        """Run one batch of sequences; one output per sequence."""

    @abstractmethod
    def finish(self, plan: RerankPlan, outputs: list[Any]) -> RerankOutput:
        """Scores from the outputs of every sequence of `plan`, in plan order."""

    @property
    def forward_key(self) -> Hashable:
        """Sequences of requests with equal keys may share one batch."""
        return ("rerank", id(self))

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> RerankOutput:
        """Score `documents` against `query` on the calling thread (the CLI, tests, bench)."""
        check_rerank_request(query, documents)
        plan = self.prepare(query, documents, truncate=truncate, instruction=instruction)
        outputs: list[Any] = [None] * len(plan.items)
        for group in plan_batches([len(x) for x in plan.items], batch_size):
            for i, out in zip(group, self.forward([plan.items[i] for i in group]), strict=True):
                outputs[i] = out
        return self.finish(plan, outputs)


def check_rerank_request(query: str, documents: Sequence[str]) -> None:
    """InvalidRequestError for an empty query or document list."""
    if not query:
        raise InvalidRequestError("the query is empty")
    if not documents:
        raise InvalidRequestError("no documents to rerank")
    for i, doc in enumerate(documents):
        if not doc:
            raise InvalidRequestError(f"document {i} is an empty string")
