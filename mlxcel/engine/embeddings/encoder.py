"""Encoder embedding models (BERT, XLM-RoBERTa, ModernBERT) loaded from a Hugging Face directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.engine.embeddings.config import EncoderConfig, encoder_config, read_config
from mlxcel.engine.embeddings.embedder import Embedder, Vector
from mlxcel.engine.embeddings.pooling import Pooling, pooled_vectors, pooling_from_dir
from mlxcel.engine.embeddings.tokenization import EmbeddingInput, TextTokenizer, TokenizedInput
from mlxcel.engine.embeddings.weights import build_encoder, read_weights

_HUGE_LIMIT = 1_000_000


@dataclass
class PaddedBatch:
    """Right-padded MLX inputs of one batch."""

    ids: mx.array
    mask: mx.array
    type_ids: mx.array
    lengths: list[int]


def pad_batch(batch: Sequence[TokenizedInput], pad_id: int) -> PaddedBatch:
    """Stack token sequences into (B, T) arrays padded on the right with `pad_id`."""
    lengths = [len(item) for item in batch]
    width = max(lengths)
    ids = np.full((len(batch), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(batch), width), dtype=np.int32)
    types = np.zeros((len(batch), width), dtype=np.int32)
    for row, item in enumerate(batch):
        n = len(item)
        ids[row, :n] = item.ids
        mask[row, :n] = 1
        if item.type_ids is not None:
            types[row, :n] = item.type_ids
    return PaddedBatch(mx.array(ids), mx.array(mask), mx.array(types), lengths)


def _json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def encoder_max_length(path: Path, config: EncoderConfig) -> int:
    """The longest input: sentence-transformers' `max_seq_length`, the tokenizer's limit,
    and the position table, whichever is smallest."""
    limits = [config.max_tokens]
    st = _json_file(path / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(st, int) and st > 0:
        limits.append(st)
    tok = _json_file(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(tok, int) and 0 < tok < _HUGE_LIMIT:
        limits.append(tok)
    return min(limits)


class EncoderModel:
    """An MLX encoder with its tokenizer: the part embedders and cross-encoders share.

    `from_dir` loads a Hugging Face directory; `mlxcel.engine.embeddings.gguf_encoder` builds
    one from a GGUF file. `default_pooling` is the pooling the checkpoint names (None: mean).
    """

    def __init__(
        self,
        *,
        path: Path,
        name: str,
        config: EncoderConfig,
        module: nn.Module,
        tokenizer: TextTokenizer,
        max_length: int,
        default_pooling: Pooling | None = None,
    ) -> None:
        self.path = path
        self.name = name
        self.config = config
        self.module = module
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.pad_id = config.pad_token_id
        self.default_pooling = default_pooling

    @classmethod
    def from_dir(cls, path: Path, *, name: str | None = None, dtype: str = "auto") -> EncoderModel:
        """Load the encoder in Hugging Face directory `path`."""
        from mlxcel.engine.loading.safety import check_model_dir

        name = name or path.name
        check_model_dir(path, name=name)
        config = encoder_config(read_config(path), name=name)
        return cls(
            path=path,
            name=name,
            config=config,
            module=build_encoder(config, read_weights(path), name=name, dtype=dtype),
            tokenizer=TextTokenizer.from_dir(path),
            max_length=encoder_max_length(path, config),
            default_pooling=pooling_from_dir(path),
        )

    def hidden(self, batch: Sequence[TokenizedInput]) -> tuple[mx.array, PaddedBatch]:
        """Hidden states (B, T, H) of one batch and the padded inputs."""
        padded = pad_batch(batch, self.pad_id)
        return self.module(padded.ids, padded.mask, padded.type_ids), padded


class EncoderEmbedder(Embedder):
    """Embeddings from an encoder: the checkpoint's pooling (`1_Pooling/config.json`, a GGUF
    file's `pooling_type`), else mean as sentence-transformers does, unless overridden."""

    kind = "encoder"

    def __init__(self, model: EncoderModel, *, pooling: Pooling | None = None) -> None:
        self.model = model
        self.name = model.name
        self.path = model.path
        self.dimension = model.config.hidden_size
        self.max_length = model.max_length
        self.default_pooling = pooling or model.default_pooling or "mean"

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        name: str | None = None,
        pooling: Pooling | None = None,
        dtype: str = "auto",
    ) -> EncoderEmbedder:
        """Load the encoder in directory `path`."""
        return cls(EncoderModel.from_dir(path, name=name, dtype=dtype), pooling=pooling)

    def tokenize(
        self, inputs: Sequence[EmbeddingInput], *, truncate: bool = True
    ) -> list[TokenizedInput]:
        return self.model.tokenizer.encode(inputs, max_length=self.max_length, truncate=truncate)

    def forward(self, batch: Sequence[TokenizedInput], pooling: Pooling) -> list[Vector]:
        hidden, padded = self.model.hidden(batch)
        return pooled_vectors(hidden, padded.mask, padded.lengths, pooling)
