"""The embedder interface shared by encoder and decoder embedding models."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from mlxcel.engine.embeddings.normalize import check_normalize, normalize
from mlxcel.engine.embeddings.pooling import Pooling, check_pooling
from mlxcel.engine.embeddings.tokenization import EmbeddingInput, TokenizedInput
from mlxcel.engine.errors import InvalidRequestError

Vector = npt.NDArray[np.float32]

DEFAULT_BATCH_SIZE = 32


@dataclass
class EmbeddingOutput:
    """Embeddings of a list of inputs, in input order.

    `vectors[i]` has shape (D,), or (tokens, D) with pooling `none`.
    """

    vectors: list[Vector]
    token_counts: list[int]
    truncated: list[bool]
    pooling: Pooling = "mean"
    normalize: int = 2
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the model read for all inputs (after truncation)."""
        return sum(self.token_counts)

    def matrix(self) -> Vector:
        """All pooled vectors as one (N, D) array."""
        if self.pooling == "none":
            raise InvalidRequestError("pooling 'none' gives one vector per token, not a matrix")
        return np.stack(self.vectors) if self.vectors else np.zeros((0, 0), np.float32)


def plan_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (less padding), longest first."""
    if batch_size < 1:
        raise ValueError("batch size must be at least 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def finish_vector(
    vector: Vector, pooling: Pooling, mode: int, dimensions: int | None = None
) -> Vector:
    """Cut a pooled vector to `dimensions` (Matryoshka style) then normalize it.

    Token vectors (pooling `none`) are returned as they are, as llama-server does.
    """
    if pooling == "none":
        return vector
    if dimensions is not None:
        if not 0 < dimensions <= vector.shape[-1]:
            raise InvalidRequestError(
                f"dimensions must be between 1 and {vector.shape[-1]} for this model, "
                f"got {dimensions}"
            )
        vector = vector[..., :dimensions]
    return normalize(vector, mode)


class Embedder(ABC):
    """An embedding model: tokenize inputs, then run batches of them to pooled vectors."""

    name: str
    path: Path
    kind: str  # "encoder" | "decoder"
    dimension: int
    max_length: int
    default_pooling: Pooling

    @abstractmethod
    def tokenize(
        self, inputs: Sequence[EmbeddingInput], *, truncate: bool = True
    ) -> list[TokenizedInput]:
        """Token ids of `inputs`; over-long inputs are cut (flagged) or refused."""

    @abstractmethod
    def forward(self, batch: Sequence[TokenizedInput], pooling: Pooling) -> list[Vector]:
        """Raw (unnormalized) vectors of one batch: (D,) each, or (tokens, D) for `none`."""

    def resolve_pooling(self, pooling: str | None) -> Pooling:
        """`pooling`, or the model's own when None."""
        return self.default_pooling if pooling is None else check_pooling(pooling)

    def embed(
        self,
        inputs: Sequence[EmbeddingInput],
        *,
        pooling: str | None = None,
        normalize: int = 2,
        truncate: bool = True,
        dimensions: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> EmbeddingOutput:
        """Embed `inputs` directly on the calling thread (the CLI and the benchmark)."""
        if not inputs:
            raise InvalidRequestError("no input to embed")
        check_normalize(normalize)
        method = self.resolve_pooling(pooling)
        tokens = self.tokenize(inputs, truncate=truncate)
        raw: list[Vector | None] = [None] * len(tokens)
        for group in plan_batches([len(t) for t in tokens], batch_size):
            outputs = self.forward([tokens[i] for i in group], method)
            for i, vector in zip(group, outputs, strict=True):
                raw[i] = vector
        vectors = [finish_vector(v, method, normalize, dimensions) for v in raw if v is not None]
        return EmbeddingOutput(
            vectors=vectors,
            token_counts=[len(t) for t in tokens],
            truncated=[t.truncated for t in tokens],
            pooling=method,
            normalize=normalize,
        )
