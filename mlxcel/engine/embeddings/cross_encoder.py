"""Cross-encoder rerankers: an encoder with a classification head reads query + document."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.engine.embeddings.encoder import EncoderModel
from mlxcel.engine.embeddings.rerank import Reranker, RerankOutput, RerankPlan, sigmoid
from mlxcel.engine.embeddings.tokenization import TokenizedInput
from mlxcel.engine.errors import ModelLoadError


class CrossEncoderReranker(Reranker):
    """Scores are the relevance logit: the single label's logit, or label 1 minus label 0."""

    kind = "cross-encoder"

    def __init__(self, model: EncoderModel) -> None:
        labels = model.config.num_labels
        if labels not in (1, 2):
            raise ModelLoadError(
                f"{model.name}: a reranker needs 1 or 2 labels, this classifier has {labels}"
            )
        self.model = model
        self.name = model.name
        self.path = model.path
        self.max_length = model.max_length

    @classmethod
    def load(
        cls, path: Path, *, name: str | None = None, dtype: str = "auto"
    ) -> CrossEncoderReranker:
        """Load the cross-encoder in directory `path`."""
        return cls(EncoderModel.from_dir(path, name=name, dtype=dtype))

    def prepare(
        self,
        query: str,
        documents: Sequence[str],
        *,
        truncate: bool = True,
        instruction: str | None = None,
    ) -> RerankPlan:
        items = self.model.tokenizer.encode_pairs(
            query, documents, max_length=self.max_length, truncate=truncate
        )
        return RerankPlan(items=list(items), documents=len(documents))

    def forward(self, batch: Sequence[TokenizedInput]) -> list[float]:
        hidden, padded = self.model.hidden(batch)
        logits = self.model.module.classify(hidden, padded.mask).astype(mx.float32)
        # Two labels: the log-odds of label 1 ("relevant"); one label: the logit itself.
        scores = logits[:, 1] - logits[:, 0] if logits.shape[-1] == 2 else logits[:, 0]
        mx.eval(scores)
        return [float(x) for x in np.array(scores)]

    def finish(self, plan: RerankPlan, outputs: list[float]) -> RerankOutput:
        items: list[TokenizedInput] = plan.items
        return RerankOutput(
            scores=list(outputs),
            relevance=[sigmoid(x) for x in outputs],
            token_counts=[len(x) for x in items],
            truncated=[x.truncated for x in items],
        )
