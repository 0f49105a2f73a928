"""Model references → embedders and rerankers (encoders run here, decoders via the text loader)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mlxcel.engine.embeddings.config import is_classifier_config, is_encoder_config, read_config
from mlxcel.engine.embeddings.embedder import Embedder
from mlxcel.engine.embeddings.pooling import Pooling, check_pooling, pooling_from_dir
from mlxcel.engine.embeddings.rerank import Reranker
from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.loading.default_model import (
    DEFAULT_EMBEDDING_NAME,
    DEFAULT_EMBEDDING_PACKAGE,
    EMBEDDING_INSTALL_HINT,
    shipped_model_dir,
)

if TYPE_CHECKING:
    from mlxcel.engine.embeddings.encoder import EncoderModel

DEFAULT_ALIASES = frozenset({"default", DEFAULT_EMBEDDING_NAME, "all-minilm-l6-v2"})
"""Names that mean the shipped all-MiniLM-L6-v2 (as `--audio-model default` means tiny.en)."""


def default_embedding_model_dir() -> Path:
    """The shipped all-MiniLM-L6-v2 directory, found without importing its package."""
    found = shipped_model_dir(DEFAULT_EMBEDDING_PACKAGE)
    if found is not None:
        return found
    raise ModelLoadError(
        f"no embedding model given and the default ({DEFAULT_EMBEDDING_NAME}) is not installed; "
        f"install it with `{EMBEDDING_INSTALL_HINT}` or pass -m MODEL"
    )


def is_default_ref(ref: str | None) -> bool:
    """Whether `ref` means the shipped model: None, or an alias such as `default`."""
    return ref is None or ref in DEFAULT_ALIASES


def _local_dir(ref: str) -> Path | None:
    """The directory `ref` names: a path, or a Hugging Face repo id in the local cache."""
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        return path
    if path.exists():
        return None  # a file (GGUF): only the text loader reads those
    from mlxcel.engine.loading.hf_cache import looks_like_repo_id, resolve_hf_repo

    if not looks_like_repo_id(ref):
        raise ModelLoadError(f"{ref}: no such file or directory, and not a Hugging Face repo id")
    try:
        return Path(resolve_hf_repo(ref))
    except ValueError as exc:
        raise ModelLoadError(str(exc).splitlines()[0]) from exc


def _is_encoder_dir(path: Path | None) -> bool:
    return path is not None and is_encoder_config(read_config(path))


def _gguf_encoder_file(ref: str | None) -> Path | None:
    """The GGUF file `ref` names when it holds an encoder (bert, jina-bert-v2, ...)."""
    if ref is None or is_default_ref(ref):
        return None
    path = Path(os.path.expanduser(ref))
    if not path.is_file():
        return None
    from mlxcel.engine.embeddings.gguf_encoder import has_gguf_magic, is_gguf_encoder

    return path if has_gguf_magic(path) and is_gguf_encoder(path) else None


def _load_gguf_encoder(path: Path, dtype: str) -> EncoderModel:
    from mlxcel.engine.embeddings.gguf_encoder import load_gguf_encoder

    return load_gguf_encoder(path, name=path.name, dtype=dtype)


def _name(ref: str | None, path: Path | None) -> str:
    if ref is None or is_default_ref(ref):
        return DEFAULT_EMBEDDING_NAME
    return path.name if path is not None and Path(os.path.expanduser(ref)).is_dir() else ref


def _cap(value: int, max_length: int | None) -> int:
    return min(value, max_length) if max_length and max_length > 0 else value


def is_encoder_model(ref: str | None) -> bool:
    """Whether `ref` names an encoder (a directory or a GGUF file the text engine cannot run).

    None (the default text model) and anything that cannot be resolved count as not;
    `default` (the shipped MiniLM) counts as one.
    """
    if ref is None:
        return False
    if is_default_ref(ref):
        return True
    try:
        return _gguf_encoder_file(ref) is not None or _is_encoder_dir(_local_dir(ref))
    except ModelLoadError:
        return False


def check_embedding_ref(ref: str | None) -> None:
    """Refuse, without reading weights, a reference `load_embedder` cannot load (ModelLoadError):
    `default` (or None) needs the shipped model, anything else the text loader's checks."""
    from mlxcel.engine.loading.resolve import check_model_ref

    if is_default_ref(ref):
        default_embedding_model_dir()
    else:
        check_model_ref(ref)


def check_reranker_ref(ref: str | None) -> None:
    """`check_embedding_ref` for `load_reranker`, plus what a causal model needs to rank: single
    "yes" and "no" tokens in its vocabulary (encoders rank by their head or by cosine)."""
    check_embedding_ref(ref)
    if ref is None or is_encoder_model(ref):
        return
    path = Path(os.path.expanduser(ref))
    if path.exists():
        from mlxcel.engine.embeddings.generative import check_yes_no_vocabulary

        check_yes_no_vocabulary(path)


def load_embedder(
    ref: str | None,
    *,
    pooling: str | None = None,
    dtype: str = "auto",
    max_length: int | None = None,
    store_dir: str | None = None,
) -> Embedder:
    """Load an embedding model; None or `default` means the shipped all-MiniLM-L6-v2.

    Encoders (BERT, XLM-RoBERTa, ModernBERT directories, llama.cpp `bert` GGUF files) run on
    mlxcel's MLX encoder; any
    other model goes through the text loader and is pooled from its last hidden states.
    `max_length` lowers the model's input limit (for example to the server's context size).
    """
    method: Pooling | None = check_pooling(pooling) if pooling is not None else None
    embedder: Embedder
    gguf = _gguf_encoder_file(ref)
    if gguf is not None:
        from mlxcel.engine.embeddings.encoder import EncoderEmbedder

        embedder = EncoderEmbedder(_load_gguf_encoder(gguf, dtype), pooling=method)
        embedder.max_length = _cap(embedder.max_length, max_length)
        return embedder
    path = default_embedding_model_dir() if ref is None or is_default_ref(ref) else _local_dir(ref)
    if path is not None and _is_encoder_dir(path):
        from mlxcel.engine.embeddings.encoder import EncoderEmbedder

        embedder = EncoderEmbedder.load(path, name=_name(ref, path), pooling=method, dtype=dtype)
    else:
        from mlxcel.engine.embeddings.decoder import DecoderEmbedder
        from mlxcel.engine.loading import load_model

        loaded = load_model(ref, store_dir=store_dir)
        own = pooling_from_dir(path) if path is not None else None
        embedder = DecoderEmbedder(loaded, pooling=method or own)
    embedder.max_length = _cap(embedder.max_length, max_length)
    return embedder


def load_reranker(
    ref: str | None,
    *,
    dtype: str = "auto",
    max_length: int | None = None,
    store_dir: str | None = None,
) -> Reranker:
    """Load a reranker; None or `default` means the shipped MiniLM used as a bi-encoder.

    Encoders (directories or `bert` GGUF files) with a sequence-classification head are
    cross-encoders; other encoders rank by
    embedding cosine; causal models are generative yes/no rerankers.
    """
    reranker: Reranker
    gguf = _gguf_encoder_file(ref)
    if gguf is not None:
        model = _load_gguf_encoder(gguf, dtype)
        if model.config.num_labels > 0:
            from mlxcel.engine.embeddings.cross_encoder import CrossEncoderReranker

            reranker = CrossEncoderReranker(model)
        else:
            from mlxcel.engine.embeddings.bi_encoder import BiEncoderReranker
            from mlxcel.engine.embeddings.encoder import EncoderEmbedder

            reranker = BiEncoderReranker(EncoderEmbedder(model))
        reranker.max_length = _cap(reranker.max_length, max_length)
        return reranker
    path = default_embedding_model_dir() if ref is None or is_default_ref(ref) else _local_dir(ref)
    if path is not None and _is_encoder_dir(path):
        if is_classifier_config(read_config(path)):
            from mlxcel.engine.embeddings.cross_encoder import CrossEncoderReranker

            reranker = CrossEncoderReranker.load(path, name=_name(ref, path), dtype=dtype)
        else:
            from mlxcel.engine.embeddings.bi_encoder import BiEncoderReranker
            from mlxcel.engine.embeddings.encoder import EncoderEmbedder

            embedder = EncoderEmbedder.load(path, name=_name(ref, path), dtype=dtype)
            reranker = BiEncoderReranker(embedder)
    else:
        from mlxcel.engine.embeddings.generative import GenerativeReranker
        from mlxcel.engine.loading import load_model

        reranker = GenerativeReranker(load_model(ref, store_dir=store_dir))
    reranker.max_length = _cap(reranker.max_length, max_length)
    return reranker


def reranker_for(embedder: Embedder) -> Reranker:
    """A bi-encoder reranker over an already loaded embedder (one model serves both)."""
    from mlxcel.engine.embeddings.bi_encoder import BiEncoderReranker

    return BiEncoderReranker(embedder)
