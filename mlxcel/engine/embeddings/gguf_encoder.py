"""BERT-family encoders read natively from GGUF files (llama.cpp's `bert` and `jina-bert-v2`).

This is what llama-server users have: bge-small/bge-base/all-MiniLM embedding models and
BERT or XLM-RoBERTa cross-encoders (bge-reranker) converted by llama.cpp. Hyperparameters
come from `bert.*` metadata, weights from the tensor directory (float types as they are,
quantized types dequantized to float32 with the `gguf` package), the tokenizer from
`tokenizer.ggml.*` (see gguf_vocab).

llama.cpp's conversion decides the shapes handled here: RoBERTa position tables are cut to
start at position 0 (so positions always count from 0), BERT cross-encoders keep only their
classifier (`cls.output`, applied to the first token's hidden state, no pooler), RoBERTa ones
a dense + tanh layer (`cls`) before it; jina-reranker-v1 has `cls` alone (tanh of it).
`<arch>.pooling_type` gives the pooling (0 none, 1 mean, 2 cls, 3 last, 4 rank = a
reranker). `jina-bert-v2` files (ALiBi, gated feed-forward) run on jina_bert.JinaBertEncoder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.engine.embeddings.bert import BertEncoder
from mlxcel.engine.embeddings.config import EncoderConfig
from mlxcel.engine.embeddings.encoder import EncoderModel
from mlxcel.engine.embeddings.gguf_vocab import gguf_encoder_tokenizer
from mlxcel.engine.embeddings.pooling import Pooling
from mlxcel.engine.embeddings.tokenization import TextTokenizer
from mlxcel.engine.embeddings.weights import load_into
from mlxcel.engine.errors import ModelLoadError

GGUF_ENCODER_ARCHITECTURES = ("bert", "jina-bert-v2")
# Encoder architectures llama.cpp converts whose graphs differ (rotary positions, MoE, ...):
# refused with a clear message rather than run wrongly.
OTHER_ENCODER_ARCHITECTURES = frozenset(
    {"jina-bert-v3", "nomic-bert", "nomic-bert-moe", "modern-bert", "neo-bert", "eurobert"}
)
GGUF_POOLINGS: dict[int, str] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}

_LAYER_PARTS = {
    "attn_q": "query",
    "attn_k": "key",
    "attn_v": "value",
    "attn_output": "attn_out",
    "attn_output_norm": "attn_norm",
    "ffn_up": "ffn_in",
    "ffn_down": "ffn_out",
    "layer_output_norm": "ffn_norm",
    "attn_q_norm": "q_norm",  # jina-bert-v2 only, from here on
    "attn_k_norm": "k_norm",
    "attn_norm_2": "attn_norm_2",
    "ffn_gate": "ffn_gate",
}
_JINA_TOP_PARTS = {
    "token_embd": "word",
    "token_types": "token_type",
    "token_embd_norm": "norm",
}
_TOP_PARTS = {
    "token_embd": "embeddings.word",
    "position_embd": "embeddings.position",
    "token_types": "embeddings.token_type",
    "token_embd_norm": "embeddings.norm",
}


def has_gguf_magic(path: Path) -> bool:
    """Whether `path` is a file that starts like a GGUF file."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of a GGUF file (ModelLoadError when the header is unreadable)."""
    from mlxcel.engine.loading.gguf import read_gguf_header

    try:
        header = read_gguf_header(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from exc
    return str(header.metadata.get("general.architecture", ""))


def is_gguf_encoder(path: Path) -> bool:
    """Whether `path` is a GGUF file of an encoder architecture (supported or not).

    Unsupported encoder architectures count, so that loading them says why they fail
    instead of handing them to the text loader.
    """
    if not path.is_file() or not has_gguf_magic(path):
        return False
    arch = gguf_architecture(path)
    return arch in GGUF_ENCODER_ARCHITECTURES or arch in OTHER_ENCODER_ARCHITECTURES


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _meta(metadata: Mapping[str, Any], arch: str, key: str, name: str, default: Any = None) -> Any:
    value = metadata.get(f"{arch}.{key}", default)
    if value is None:
        raise ModelLoadError(f"{name}: GGUF metadata {arch}.{key} is missing")
    return _plain(value)


def gguf_pooling(metadata: Mapping[str, Any], arch: str = "bert") -> str | None:
    """The pooling the file names (`none`, `mean`, `cls`, `last`, `rank`), or None."""
    value = metadata.get(f"{arch}.pooling_type")
    return None if value is None else GGUF_POOLINGS.get(int(_plain(value)))


def gguf_encoder_config(
    metadata: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *, name: str
) -> tuple[EncoderConfig, str]:
    """The encoder's configuration and classification head (see bert.HEADS)."""
    arch = str(metadata.get("general.architecture", ""))
    jina = arch == "jina-bert-v2"
    for tensor in ("token_embd.weight",) if jina else ("token_embd.weight", "position_embd.weight"):
        if tensor not in shapes:
            raise ModelLoadError(f"{name}: no {tensor} tensor; not a BERT encoder")
    if not jina and any(".ffn_gate." in t for t in shapes):
        raise ModelLoadError(f"{name}: gated feed-forward layers are not BERT's; not supported")
    labels, head = 0, "linear"
    if "cls.output.weight" in shapes:
        labels, head = shapes["cls.output.weight"][0], "dense" if "cls.weight" in shapes else head
    elif "cls.weight" in shapes:
        labels, head = shapes["cls.weight"][0], "tanh"
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    hidden = int(_meta(metadata, arch, "embedding_length", name))
    config = EncoderConfig(
        family="bert",
        model_type=arch,
        vocab_size=int(shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        num_layers=int(_meta(metadata, arch, "block_count", name)),
        num_heads=int(_meta(metadata, arch, "attention.head_count", name)),
        intermediate_size=int(_meta(metadata, arch, "feed_forward_length", name, 4 * hidden)),
        max_position_embeddings=int(
            _meta(metadata, arch, "context_length", name)
            if jina
            else shapes["position_embd.weight"][0]
        ),
        layer_norm_eps=float(_meta(metadata, arch, "attention.layer_norm_epsilon", name, 1e-12)),
        hidden_act="gelu",
        type_vocab_size=int(shapes["token_types.weight"][0])
        if "token_types.weight" in shapes
        else 0,
        pad_token_id=int(_plain(pad)) if pad is not None else 0,
        num_labels=int(labels),
    )
    if config.hidden_size % config.num_heads:
        raise ModelLoadError(f"{name}: {hidden} hidden units do not split into the heads")
    return config, head


def _module_name(tensor: str, head: str, jina: bool = False) -> list[str] | None:
    """Module parameter name(s) of a GGUF tensor (two or three for fused ones), or None."""
    stem, _, leaf = tensor.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk":
        if parts[2] == "attn_qkv":
            return [f"layers.{parts[1]}.{p}.{leaf}" for p in ("query", "key", "value")]
        part = _LAYER_PARTS.get(parts[2])
        return [f"layers.{parts[1]}.{part}.{leaf}"] if part else None
    if stem == "cls.output":
        return [f"classifier.{leaf}"]
    if stem == "cls":
        return [f"{'head_dense' if head == 'dense' else 'classifier'}.{leaf}"]
    part = (_JINA_TOP_PARTS if jina else _TOP_PARTS).get(stem)
    return [f"{part}.{leaf}"] if part else None


def _encoder_module(
    arch: str, config: EncoderConfig, head: str, shapes: Mapping[str, tuple[int, ...]]
) -> nn.Module:
    """The MLX module for `arch`, shaped after the file's tensors."""
    if arch != "jina-bert-v2":
        return BertEncoder(config, head=head)
    from mlxcel.engine.embeddings.jina_bert import JinaBertEncoder

    up = shapes.get("blk.0.ffn_up.weight", (config.intermediate_size,))
    if "blk.0.ffn_gate.weight" in shapes:
        gate = "separate"
    elif up[0] == 2 * config.intermediate_size:
        gate = "fused"
    else:
        gate = "none"
    return JinaBertEncoder(
        config,
        head=head,
        qk_norm="blk.0.attn_q_norm.weight" in shapes,
        norm_2="blk.0.attn_norm_2.weight" in shapes,
        gate=gate,
        up_bias="blk.0.ffn_up.bias" in shapes,
    )


def load_gguf_encoder(path: Path, *, name: str | None = None, dtype: str = "auto") -> EncoderModel:
    """Load the BERT-family encoder (embedding model or cross-encoder) in GGUF file `path`."""
    from mlxcel.engine.loading.gguf import read_gguf_header, read_tensor_values

    name = name or path.name
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{name}: {exc}") from exc
    metadata = header.metadata
    arch = str(metadata.get("general.architecture", ""))
    if arch not in GGUF_ENCODER_ARCHITECTURES:
        raise ModelLoadError(
            f"{name}: GGUF architecture {arch!r} is not supported for embeddings or reranking "
            f"(supported: {', '.join(GGUF_ENCODER_ARCHITECTURES)})"
        )
    shapes = {t.name: t.shape for t in header.tensors}
    config, head = gguf_encoder_config(metadata, shapes, name=name)
    size = path.stat().st_size
    for info in header.tensors:
        if info.offset + info.nbytes > size:
            raise ModelLoadError(
                f"{name}: truncated or corrupt GGUF: tensor {info.name} needs bytes up to "
                f"{info.offset + info.nbytes}, the file has {size}"
            )
    module = _encoder_module(arch, config, head, shapes)
    weights: dict[str, mx.array] = {}
    with open(path, "rb") as f:
        for info in header.tensors:
            targets = _module_name(info.name, head, jina=arch == "jina-bert-v2")
            if targets is None:
                continue
            try:
                values = read_tensor_values(f, info)
            except ValueError as exc:
                raise ModelLoadError(f"{name}: {exc}") from exc
            for target, part in zip(targets, np.split(values, len(targets)), strict=True):
                weights[target] = mx.array(np.ascontiguousarray(part))
    load_into(module, weights, name=name, dtype=dtype)
    backend = gguf_encoder_tokenizer(metadata, name=name, typed=config.type_vocab_size > 1)
    pooling = gguf_pooling(metadata, arch)
    default: Pooling | None = None
    if pooling in ("none", "mean", "cls", "last"):
        default = pooling  # type: ignore[assignment]
    elif pooling == "rank":
        default = "cls"
    return EncoderModel(
        path=path,
        name=name,
        config=config,
        module=module,
        tokenizer=TextTokenizer(backend),
        max_length=config.max_tokens,
        default_pooling=default,
    )
