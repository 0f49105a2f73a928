"""Decoder embedding models (Qwen3-Embedding style): a text model read through its last token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxcel.engine.embeddings.embedder import Embedder, Vector
from mlxcel.engine.embeddings.encoder import PaddedBatch, pad_batch
from mlxcel.engine.embeddings.pooling import Pooling, pool, pooled_vectors
from mlxcel.engine.embeddings.tokenization import EmbeddingInput, TextTokenizer, TokenizedInput
from mlxcel.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from mlxcel.engine.loading.model import LoadedModel


class DecoderModel:
    """A loaded causal text model seen as hidden states and last-token logits.

    Inputs are padded on the right: causal attention keeps padding out of every real
    token's state, so each row is read at its own last position.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.name = loaded.info.name
        self.path = loaded.info.path
        self.network: Any = loaded.model
        self.backbone: Any = getattr(self.network, "model", None)
        if self.backbone is None or not callable(self.backbone):
            raise ModelLoadError(
                f"{self.name}: cannot reach the hidden states of a {loaded.info.architecture} model"
            )
        hf = getattr(loaded.tokenizer, "hf", None)
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if backend is None:
            raise ModelLoadError(f"{self.name}: the tokenizer has no fast (Rust) backend")
        self.tokenizer = TextTokenizer(backend)
        self.max_length = int(loaded.info.context_length)
        self.pad_id = 0

    def hidden(self, batch: Sequence[TokenizedInput]) -> tuple[mx.array, PaddedBatch]:
        """Final hidden states (B, T, H) of a right-padded batch."""
        padded = pad_batch(batch, self.pad_id)
        return self.backbone(padded.ids), padded

    def last_logits(self, batch: Sequence[TokenizedInput]) -> mx.array:
        """Next-token logits (B, V) after each sequence's last token."""
        hidden, padded = self.hidden(batch)
        last = pool(hidden, padded.mask, "last")[:, None, :]
        head = getattr(self.network, "lm_head", None)
        if head is not None:
            return head(last)[:, 0]
        embed = getattr(self.backbone, "embed_tokens", None)
        if embed is not None and hasattr(embed, "as_linear"):
            return embed.as_linear(last)[:, 0]
        logits = self.network(padded.ids)
        index = mx.array([n - 1 for n in padded.lengths])
        return mx.take_along_axis(logits, index[:, None, None], axis=1)[:, 0]


class DecoderEmbedder(Embedder):
    """Embeddings from a causal model, last-token pooling by default."""

    kind = "decoder"

    def __init__(self, loaded: LoadedModel, *, pooling: Pooling | None = None) -> None:
        self.model = DecoderModel(loaded)
        self.name = self.model.name
        self.path = self.model.path
        self.max_length = self.model.max_length
        self.default_pooling = pooling or "last"
        probe, _ = self.model.hidden([TokenizedInput((0,))])
        self.dimension = int(probe.shape[-1])

    def tokenize(
        self, inputs: Sequence[EmbeddingInput], *, truncate: bool = True
    ) -> list[TokenizedInput]:
        return self.model.tokenizer.encode(inputs, max_length=self.max_length, truncate=truncate)

    def forward(self, batch: Sequence[TokenizedInput], pooling: Pooling) -> list[Vector]:
        hidden, padded = self.model.hidden(batch)
        return pooled_vectors(hidden, padded.mask, padded.lengths, pooling)
