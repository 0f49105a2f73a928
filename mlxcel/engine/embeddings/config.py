"""Encoder model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import ModelLoadError

BERT_TYPES = frozenset({"bert"})
ROBERTA_TYPES = frozenset({"roberta", "xlm-roberta", "xlm_roberta", "camembert"})
MODERNBERT_TYPES = frozenset({"modernbert"})
ENCODER_TYPES = BERT_TYPES | ROBERTA_TYPES | MODERNBERT_TYPES


@dataclass(frozen=True)
class EncoderConfig:
    """The facts an MLX encoder needs, for the BERT, XLM-RoBERTa and ModernBERT families."""

    family: str  # "bert" | "roberta" | "modernbert"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    hidden_act: str
    type_vocab_size: int = 2
    pad_token_id: int = 0
    # ModernBERT only
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    local_attention: int = 128
    global_attn_every_n_layers: int = 3
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" (newer configs)
    # sequence classification (cross-encoders)
    num_labels: int = 0
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False

    def is_global_layer(self, index: int) -> bool:
        """Whether ModernBERT layer `index` attends globally (else within its window)."""
        if self.layer_types:
            return self.layer_types[index] != "sliding_attention"
        return index % self.global_attn_every_n_layers == 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_offset(self) -> int:
        """Positions RoBERTa-style models reserve before the first token (padding_idx + 1)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position table allows."""
        return self.max_position_embeddings - self.position_offset


def read_config(path: Path) -> dict[str, Any]:
    """The parsed `config.json` of a model directory."""
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path.name}: no config.json; not a Hugging Face model directory")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.name}: config.json is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name}: config.json is not a JSON object")
    return data


def model_type_of(config: dict[str, Any]) -> str:
    """The normalized `model_type` of a config (lower case, `_` for `-` kept as written)."""
    return str(config.get("model_type", "")).lower()


def is_encoder_config(config: dict[str, Any]) -> bool:
    """Whether the config names an encoder family this module can run."""
    return model_type_of(config) in ENCODER_TYPES


def is_classifier_config(config: dict[str, Any]) -> bool:
    """Whether the config describes a sequence-classification model (a cross-encoder)."""
    archs = config.get("architectures") or []
    return any(str(a).endswith("ForSequenceClassification") for a in archs)


def _num_labels(config: dict[str, Any]) -> int:
    if "num_labels" in config:
        return int(config["num_labels"])
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else 2


def _pad_id(config: dict[str, Any], family: str) -> int:
    pad = config.get("pad_token_id")
    if pad is None:
        return 1 if family == "roberta" else 0
    return int(pad)


def encoder_config(config: dict[str, Any], *, name: str = "model") -> EncoderConfig:
    """Build an `EncoderConfig` from a Hugging Face config dict."""
    model_type = model_type_of(config)
    if model_type in BERT_TYPES:
        family = "bert"
    elif model_type in ROBERTA_TYPES:
        family = "roberta"
    elif model_type in MODERNBERT_TYPES:
        family = "modernbert"
    else:
        raise ModelLoadError(
            f"{name}: model_type {model_type or '(none)'!r} is not an encoder family mlxcel runs "
            "(bert, roberta, xlm-roberta, modernbert)"
        )
    try:
        hidden = int(config["hidden_size"])
        common: dict[str, Any] = {
            "family": family,
            "model_type": model_type,
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": hidden,
            "num_layers": int(config["num_hidden_layers"]),
            "num_heads": int(config["num_attention_heads"]),
            "intermediate_size": int(config.get("intermediate_size", 4 * hidden)),
            "max_position_embeddings": int(config.get("max_position_embeddings", 512)),
            "pad_token_id": _pad_id(config, family),
            "num_labels": _num_labels(config) if is_classifier_config(config) else 0,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{name}: config.json lacks a usable {exc} field") from exc
    if family == "modernbert":
        # transformers 5 writes `rope_parameters` and `layer_types`; older checkpoints
        # `global_rope_theta`, `local_rope_theta` and `global_attn_every_n_layers`.
        rope = config.get("rope_parameters")
        rope = rope if isinstance(rope, dict) else {}
        full = rope.get("full_attention") or {}
        sliding = rope.get("sliding_attention") or {}
        layer_types = config.get("layer_types") or ()
        if layer_types and len(layer_types) != common["num_layers"]:
            raise ModelLoadError(f"{name}: layer_types does not list every layer")
        return EncoderConfig(
            **common,
            layer_norm_eps=float(config.get("norm_eps", 1e-5)),
            hidden_act=str(config.get("hidden_activation", "gelu")),
            type_vocab_size=0,
            norm_bias=bool(config.get("norm_bias", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            global_rope_theta=float(
                full.get("rope_theta", config.get("global_rope_theta", 160_000.0))
            ),
            local_rope_theta=float(
                sliding.get("rope_theta", config.get("local_rope_theta", 10_000.0))
            ),
            local_attention=int(config.get("local_attention", 128)),
            global_attn_every_n_layers=int(config.get("global_attn_every_n_layers", 3)),
            layer_types=tuple(str(t) for t in layer_types),
            classifier_pooling=str(config.get("classifier_pooling", "cls")),
            classifier_activation=str(config.get("classifier_activation", "gelu")),
            classifier_bias=bool(config.get("classifier_bias", False)),
        )
    return EncoderConfig(
        **common,
        layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        hidden_act=str(config.get("hidden_act", "gelu")),
        type_vocab_size=int(config.get("type_vocab_size", 2)),
    )
