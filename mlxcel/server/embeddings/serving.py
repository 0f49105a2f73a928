"""Turn embedding requests into worker jobs and worker outputs into the two response shapes."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxcel.server.bridge import await_engine

if TYPE_CHECKING:
    from mlxcel.engine.embeddings.embedder import EmbeddingOutput
    from mlxcel.engine.workers.embedding_worker import EmbeddingWorker
    from mlxcel.server.embeddings.protocol import EmbeddingItem

DEFAULT_MAX_INPUTS = 2048
DEFAULT_TIMEOUT_SECONDS = 600.0


class EmbeddingService:
    """Embeddings over one worker: defaults from the server settings, shapes for each route."""

    def __init__(
        self,
        worker: EmbeddingWorker,
        *,
        model_name: str,
        normalize: int = 2,
        max_inputs: int = DEFAULT_MAX_INPUTS,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        if worker.embedder is None:
            raise ValueError("the worker has no embedding model")
        self.worker = worker
        self.embedder = worker.embedder
        self.model_name = model_name
        self.normalize = normalize
        self.max_inputs = max_inputs
        self.timeout = timeout if timeout and timeout > 0 else None

    @property
    def pooling(self) -> str:
        return self.embedder.default_pooling

    async def embed(
        self,
        inputs: Sequence[EmbeddingItem],
        *,
        normalize: int | None = None,
        truncate: bool = True,
        dimensions: int | None = None,
    ) -> EmbeddingOutput:
        """Run `inputs` on the worker."""
        mode = self.normalize if normalize is None else normalize
        return await await_engine(
            lambda: self.worker.embed(
                list(inputs), normalize=mode, truncate=truncate, dimensions=dimensions
            ),
            self.timeout,
        )


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode("ascii")


def openai_response(
    output: EmbeddingOutput, *, model: str, encoding_format: str = "float"
) -> dict[str, Any]:
    """The OpenAI list object; an item whose input was cut carries `truncated: true`."""
    data = []
    for i, vector in enumerate(output.vectors):
        item: dict[str, Any] = {
            "object": "embedding",
            "index": i,
            "embedding": _b64(vector) if encoding_format == "base64" else vector.tolist(),
        }
        if output.truncated[i]:
            item["truncated"] = True
        data.append(item)
    tokens = output.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def native_response(output: EmbeddingOutput) -> list[dict[str, Any]]:
    """llama-server's array: `embedding` holds one pooled vector, or every token's vector."""
    out = []
    for i, vector in enumerate(output.vectors):
        rows = vector.tolist() if vector.ndim == 2 else [vector.tolist()]
        item: dict[str, Any] = {"index": i, "embedding": rows}
        if output.truncated[i]:
            item["truncated"] = True
        out.append(item)
    return out
