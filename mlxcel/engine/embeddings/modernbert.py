"""ModernBERT encoder in MLX: pre-norm blocks, rotary positions, local/global attention."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn

from mlxcel.engine.embeddings.config import EncoderConfig
from mlxcel.engine.embeddings.layers import (
    activation,
    key_padding_bias,
    merge_heads,
    window_bias,
)


class ModernBertLayer(nn.Module):
    """One pre-norm block; layers that are not global attend within a sliding window."""

    def __init__(self, config: EncoderConfig, index: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.is_global = config.is_global_layer(index)
        self.rope_theta = config.global_rope_theta if self.is_global else config.local_rope_theta
        self.window = config.local_attention
        if index > 0:  # the first block reuses the embedding norm
            self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.wqkv = nn.Linear(h, 3 * h, bias=config.attention_bias)
        self.wo = nn.Linear(h, h, bias=config.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, bias=config.norm_bias)
        self.wi = nn.Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.wo_mlp = nn.Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.act = activation(config.hidden_act)

    def _rope(self, x: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=0
        )

    def __call__(self, x: mx.array, padding: mx.array) -> mx.array:
        b, t, _ = x.shape
        normed = self.attn_norm(x) if "attn_norm" in self else x
        qkv = self.wqkv(normed).reshape(b, t, 3, self.heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        q, k = self._rope(q), self._rope(k)
        bias = padding if self.is_global else padding + window_bias(t, self.window, x.dtype)
        attn = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
        x = x + self.wo(merge_heads(attn))
        gate_in, gate = mx.split(self.wi(self.mlp_norm(x)), 2, axis=-1)
        return x + self.wo_mlp(self.act(gate_in) * gate)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings followed by LayerNorm (no positions: ModernBERT uses rotary)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias
        )

    def __call__(self, ids: mx.array) -> mx.array:
        return self.norm(self.word(ids))


class ModernBertEncoder(nn.Module):
    """A ModernBERT encoder: `__call__` gives hidden states, `classify` gives logits."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = [ModernBertLayer(config, i) for i in range(config.num_layers)]
        h = config.hidden_size
        self.final_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, bias=config.norm_bias)
        if config.num_labels > 0:
            self.head_dense = nn.Linear(h, h, bias=config.classifier_bias)
            self.head_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, bias=config.norm_bias)
            self.classifier = nn.Linear(h, config.num_labels)
            self.head_act = activation(config.classifier_activation)

    def __call__(self, ids: mx.array, mask: mx.array, type_ids: mx.array | None = None) -> mx.array:
        """Hidden states (B, T, H) of right-padded `ids`; `type_ids` is ignored."""
        x = self.embeddings(ids)
        padding = key_padding_bias(mask, x.dtype)
        for layer in self.layers:
            x = layer(x, padding)
        return self.final_norm(x)

    def classify(self, hidden: mx.array, mask: mx.array) -> mx.array:
        """Sequence-classification logits (B, num_labels) from hidden states."""
        if self.config.classifier_pooling == "mean":
            weights = mask[..., None].astype(hidden.dtype)
            pooled = (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)
        else:
            pooled = hidden[:, 0]
        return self.classifier(self.head_norm(self.head_act(self.head_dense(pooled))))


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "wqkv",
    "attn.Wo": "wo",
    "mlp_norm": "mlp_norm",
    "mlp.Wi": "wi",
    "mlp.Wo": "wo_mlp",
}
_TOP_PARTS = {
    "embeddings.tok_embeddings": "embeddings.word",
    "embeddings.norm": "embeddings.norm",
    "final_norm": "final_norm",
    "head.dense": "head_dense",
    "head.norm": "head_norm",
    "classifier": "classifier",
}


def modernbert_weight_name(name: str) -> str | None:
    """Map a Hugging Face ModernBERT weight name to this module's name (None: not used)."""
    name = name.removeprefix("model.")
    stem, _, leaf = name.rpartition(".")
    match = _LAYER.match(stem)
    if match:
        part = _LAYER_PARTS.get(match.group(2))
        return f"layers.{match.group(1)}.{part}.{leaf}" if part else None
    part = _TOP_PARTS.get(stem)
    return f"{part}.{leaf}" if part else None
