"""Jina BERT v2 encoders (llama.cpp's `jina-bert-v2`: jina-embeddings-v2, jina-reranker-v1).

A post-norm BERT without a position table: attention is biased by ALiBi, symmetric for an
encoder (head h adds -slope_h * |i - j|, slopes as ggml's soft_max with max_bias 8), and the
feed-forward layer is gated: GELU of the first half of `ffn_up` times its second half when
`ffn_up` holds both (GEGLU), or GELU(`ffn_gate` x) times `ffn_up` x. Optional per-layer
LayerNorms on Q and K (`attn_q_norm`, `attn_k_norm`) and a second attention norm
(`attn_norm_2`, applied to the normed output plus the layer input again) are used when the
file has them, as in llama.cpp's graph.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlxcel.engine.embeddings.bert import HEADS, head_logits
from mlxcel.engine.embeddings.config import EncoderConfig
from mlxcel.engine.embeddings.layers import key_padding_bias, merge_heads, split_heads

MAX_ALIBI_BIAS = 8.0


def alibi_slopes(heads: int, max_bias: float = MAX_ALIBI_BIAS) -> list[float]:
    """ALiBi slopes per head, as ggml computes them (also for head counts not a power of 2)."""
    base = 2 ** math.floor(math.log2(heads))
    m0 = 2.0 ** (-max_bias / base)
    m1 = 2.0 ** (-(max_bias / 2.0) / base)
    return [m0 ** (h + 1) if h < base else m1 ** (2 * (h - base) + 1) for h in range(heads)]


def alibi_bias(length: int, heads: int, dtype: mx.Dtype) -> mx.array:
    """Symmetric ALiBi bias (1, heads, T, T): -slope_h * |i - j|."""
    pos = mx.arange(length)
    distance = mx.abs(pos[:, None] - pos[None, :]).astype(mx.float32)
    slopes = mx.array(alibi_slopes(heads), dtype=mx.float32)[:, None, None]
    return (-slopes * distance)[None].astype(dtype)


class JinaBertLayer(nn.Module):
    """One post-norm block with ALiBi attention and a gated feed-forward layer."""

    def __init__(
        self,
        config: EncoderConfig,
        *,
        qk_norm: bool = False,
        norm_2: bool = False,
        gate: str = "fused",  # "fused" (GEGLU in ffn_up) | "separate" (ffn_gate) | "none"
        up_bias: bool = True,
    ) -> None:
        super().__init__()
        h, ff, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.heads = config.num_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        if qk_norm:
            self.q_norm = nn.LayerNorm(h, eps=eps)
            self.k_norm = nn.LayerNorm(h, eps=eps)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        if norm_2:
            self.attn_norm_2 = nn.LayerNorm(h, eps=eps)
        self._gate = gate
        self.ffn_in = nn.Linear(h, 2 * ff if gate == "fused" else ff, bias=up_bias)
        if gate == "separate":
            self.ffn_gate = nn.Linear(h, ff, bias=False)
        self.ffn_out = nn.Linear(ff, h)
        self.ffn_norm = nn.LayerNorm(h, eps=eps)
        self._qk_norm, self._norm_2 = qk_norm, norm_2

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        q, k = self.query(x), self.key(x)
        if self._qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (split_heads(t, self.heads) for t in (q, k, self.value(x)))
        attn = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
        h = self.attn_norm(x + self.attn_out(merge_heads(attn)))
        if self._norm_2:
            h = self.attn_norm_2(h + x)
        up = self.ffn_in(h)
        if self._gate == "fused":
            act, mul = mx.split(up, 2, axis=-1)
            inner = nn.gelu(act) * mul
        elif self._gate == "separate":
            inner = nn.gelu(self.ffn_gate(h)) * up
        else:
            inner = nn.gelu(up)
        return self.ffn_norm(h + self.ffn_out(inner))


class JinaBertEncoder(nn.Module):
    """A Jina BERT v2 encoder: `__call__` gives hidden states, `classify` gives logits."""

    def __init__(
        self,
        config: EncoderConfig,
        *,
        head: str = "tanh",
        qk_norm: bool = False,
        norm_2: bool = False,
        gate: str = "fused",
        up_bias: bool = True,
    ) -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"unknown classification head {head!r}")
        self.config = config
        h = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, h)
        if config.type_vocab_size > 0:
            self.token_type = nn.Embedding(config.type_vocab_size, h)
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = [
            JinaBertLayer(config, qk_norm=qk_norm, norm_2=norm_2, gate=gate, up_bias=up_bias)
            for _ in range(config.num_layers)
        ]
        self._head = head
        if config.num_labels > 0:
            if head == "dense":
                self.head_dense = nn.Linear(h, h)
            self.classifier = nn.Linear(h, config.num_labels)

    def __call__(self, ids: mx.array, mask: mx.array, type_ids: mx.array | None = None) -> mx.array:
        """Hidden states (B, T, H) of right-padded `ids` with attention `mask` (1 = token)."""
        x = self.word(ids)
        if self.config.type_vocab_size > 0:
            x = x + self.token_type(mx.zeros_like(ids) if type_ids is None else type_ids)
        x = self.norm(x)
        bias = key_padding_bias(mask, x.dtype) + alibi_bias(
            ids.shape[1], self.config.num_heads, x.dtype
        )
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def classify(self, hidden: mx.array, mask: mx.array) -> mx.array:
        """Sequence-classification logits (B, num_labels) from hidden states."""
        return head_logits(self, self._head, hidden[:, 0])
