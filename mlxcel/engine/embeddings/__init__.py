"""Embedding and reranking models: MLX encoders (BERT, XLM-RoBERTa, ModernBERT), decoder
embedders through the text loader, cross-encoder, generative and bi-encoder rerankers.

Importing this package loads no MLX code; the model modules import it when a model loads.
"""

from mlxcel.engine.embeddings.embedder import Embedder, EmbeddingOutput, plan_batches
from mlxcel.engine.embeddings.loader import (
    DEFAULT_EMBEDDING_NAME,
    default_embedding_model_dir,
    load_embedder,
    load_reranker,
    reranker_for,
)
from mlxcel.engine.embeddings.normalize import normalize
from mlxcel.engine.embeddings.pooling import POOLINGS, Pooling
from mlxcel.engine.embeddings.rerank import Reranker, RerankOutput
from mlxcel.engine.embeddings.tokenization import EmbeddingInput, TokenizedInput

__all__ = [
    "DEFAULT_EMBEDDING_NAME",
    "POOLINGS",
    "EmbeddingInput",
    "EmbeddingOutput",
    "Embedder",
    "Pooling",
    "RerankOutput",
    "Reranker",
    "TokenizedInput",
    "default_embedding_model_dir",
    "load_embedder",
    "load_reranker",
    "normalize",
    "plan_batches",
    "reranker_for",
]
