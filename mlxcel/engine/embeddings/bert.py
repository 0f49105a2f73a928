"""BERT and (XLM-)RoBERTa encoders in MLX, with their sequence-classification heads."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn

from mlxcel.engine.embeddings.config import EncoderConfig
from mlxcel.engine.embeddings.layers import activation, key_padding_bias, merge_heads, split_heads


class BertEmbeddings(nn.Module):
    """Word + position (+ token type) embeddings, then LayerNorm."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        if config.type_vocab_size > 0:
            self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self._roberta = config.family == "roberta"
        self._pad = config.pad_token_id
        self._typed = config.type_vocab_size > 0

    def __call__(self, ids: mx.array, type_ids: mx.array, mask: mx.array) -> mx.array:
        if self._roberta:
            # RoBERTa numbers real tokens from padding_idx + 1 and gives padding padding_idx.
            positions = mx.cumsum(mask, axis=1) * mask + self._pad
        else:
            positions = mx.broadcast_to(mx.arange(ids.shape[1])[None], ids.shape)
        x = self.word(ids) + self.position(positions)
        if self._typed:
            x = x + self.token_type(type_ids)
        return self.norm(x)


class BertLayer(nn.Module):
    """One post-norm transformer block."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(h, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.act = activation(config.hidden_act)

    def __call__(self, x: mx.array, bias: mx.array) -> mx.array:
        q = split_heads(self.query(x), self.heads)
        k = split_heads(self.key(x), self.heads)
        v = split_heads(self.value(x), self.heads)
        attn = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=bias)
        x = self.attn_norm(x + self.attn_out(merge_heads(attn)))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


HEADS = ("pooler", "dense", "linear", "tanh")
"""Classification heads on the first token's hidden state h:

- `pooler`: classifier(tanh(pooler(h))), BERT's sequence classifier;
- `dense`: classifier(tanh(head_dense(h))), RoBERTa's (and llama.cpp's `cls` + `cls.output`);
- `linear`: classifier(h), llama.cpp's `cls.output` alone (its BERT cross-encoders);
- `tanh`: tanh(classifier(h)), llama.cpp's `cls` alone.
"""


class BertEncoder(nn.Module):
    """A BERT-family encoder: `__call__` gives hidden states, `classify` gives logits.

    `pooler` exists when the checkpoint has one; `head` picks the classification head
    (one of HEADS; default `dense` for RoBERTa, `pooler` for BERT). Plain embedding models
    have neither.
    """

    def __init__(
        self, config: EncoderConfig, *, with_pooler: bool = False, head: str | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = [BertLayer(config) for _ in range(config.num_layers)]
        h = config.hidden_size
        self._head = head or ("dense" if config.family == "roberta" else "pooler")
        if self._head not in HEADS:
            raise ValueError(f"unknown classification head {self._head!r}")
        if config.num_labels > 0:
            if self._head == "dense":
                self.head_dense = nn.Linear(h, h)
            elif self._head == "pooler":
                with_pooler = True
            self.classifier = nn.Linear(h, config.num_labels)
        if with_pooler:
            self.pooler = nn.Linear(h, h)

    def __call__(self, ids: mx.array, mask: mx.array, type_ids: mx.array | None = None) -> mx.array:
        """Hidden states (B, T, H) of right-padded `ids` with attention `mask` (1 = token)."""
        if type_ids is None:
            type_ids = mx.zeros_like(ids)
        x = self.embeddings(ids, type_ids, mask)
        bias = key_padding_bias(mask, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        return x

    def classify(self, hidden: mx.array, mask: mx.array) -> mx.array:
        """Sequence-classification logits (B, num_labels) from hidden states."""
        return head_logits(self, self._head, hidden[:, 0])


def head_logits(module: nn.Module, head: str, first: mx.array) -> mx.array:
    """Logits of classification head `head` (see HEADS) of `module` on first-token states."""
    if head == "dense":
        return module.classifier(mx.tanh(module.head_dense(first)))
    if head == "pooler":
        return module.classifier(mx.tanh(module.pooler(first)))
    logits = module.classifier(first)
    return mx.tanh(logits) if head == "tanh" else logits


_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYER_PARTS = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_TOP_PARTS = {
    "embeddings.word_embeddings": "embeddings.word",
    "embeddings.position_embeddings": "embeddings.position",
    "embeddings.token_type_embeddings": "embeddings.token_type",
    "embeddings.LayerNorm": "embeddings.norm",
    "pooler.dense": "pooler",
    "classifier.dense": "head_dense",
    "classifier.out_proj": "classifier",
    "classifier": "classifier",
}
_PREFIXES = ("bert.", "roberta.", "xlm_roberta.", "camembert.", "model.", "0.auto_model.")


def bert_weight_name(name: str) -> str | None:
    """Map a Hugging Face BERT/RoBERTa weight name to this module's name (None: not used)."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    stem, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    match = _LAYER.match(stem)
    if match:
        part = _LAYER_PARTS.get(match.group(2))
        return f"layers.{match.group(1)}.{part}.{leaf}" if part else None
    part = _TOP_PARTS.get(stem)
    return f"{part}.{leaf}" if part else None
