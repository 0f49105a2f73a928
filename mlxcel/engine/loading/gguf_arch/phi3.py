"""`phi3` GGUF files (Phi-3, Phi-3.5 mini, Phi-4 mini): mlx-lm's `phi3` class.

llama.cpp keeps Hugging Face's fused projections: `attn_qkv` is `qkv_proj` and `ffn_up`
is `gate_up_proj` (gate rows first); files with separate `attn_q/k/v` get them joined.
Q/K rows are not permuted (NeoX RoPE). The 128k-context variants (LongRoPE) store their
per-frequency factors as tensors, `rope_factors_long` and `rope_factors_short`, with the
trained and original context lengths and the attention factor as metadata: they become the
class's `rope_scaling` (`SuScaledRoPE`). mlx-lm's class applies the long factors at every
length and derives the attention factor from the two lengths; a file whose factor differs
is refused rather than run with another one.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture

_LAYER_TENSORS = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SEPARATE = ("q_proj", "k_proj", "v_proj")
_LONG, _SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    per_head = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(hyper.get("rope.dimension_count", per_head))
    original = int(
        hyper.get("rope.scaling.original_context_length", config["max_position_embeddings"])
    )
    extras: dict[str, Any] = {
        "partial_rotary_factor": rotary / per_head,
        "original_max_position_embeddings": original,
    }
    if _LONG in hyper.tensor_names:
        extras["rope_scaling"] = _long_rope(hyper, rotary, config["max_position_embeddings"])
    return extras


def _long_rope(hyper: ArchMetadata, rotary: int, context: int) -> dict[str, Any]:
    """mlx-lm's `rope_scaling` for a LongRoPE file (the factors of its `rotary` dimensions,
    trained for `context` tokens)."""
    long = hyper.tensor(_LONG)
    short = hyper.tensor(_SHORT) if _SHORT in hyper.tensor_names else long
    if long.shape != (rotary // 2,) or short.shape != long.shape:
        raise ValueError(
            f"phi3 LongRoPE factors have {long.size} and {short.size} values, "
            f"not {rotary // 2} (half the rotary dimensions)"
        )
    original = int(hyper.get("rope.scaling.original_context_length"))
    scale = context / original
    expected = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = float(hyper.get("rope.scaling.attn_factor", expected))
    if abs(stored - expected) > 1e-4 * expected:
        raise ValueError(
            f"phi3 LongRoPE attention factor {stored:g} is not the {expected:g} that "
            f"mlx-lm's class derives from the context lengths {context} and {original}"
        )
    return {
        "type": "longrope",
        "long_factor": long.tolist(),
        "short_factor": short.tolist(),
    }


def _join_qkv(weights: dict[str, Any], _config: dict[str, Any]) -> None:
    """Separate Q/K/V projections (and their scales/biases) → mlx-lm's fused `qkv_proj`."""
    for key in [k for k in weights if ".self_attn.q_proj." in k]:
        prefix, suffix = key.split(".self_attn.q_proj.")
        parts = [weights.pop(f"{prefix}.self_attn.{p}.{suffix}") for p in _SEPARATE]
        weights[f"{prefix}.self_attn.qkv_proj.{suffix}"] = mx.concatenate(parts, axis=0)


ARCHITECTURE = GGUFArchitecture(
    name="phi3",
    model_type="phi3",
    hf_architecture="Phi3ForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-5,
    layer_tensors=_LAYER_TENSORS,
    extra_config=_extras,
    fix_weights=_join_qkv,
    config_tensors=frozenset({_LONG, _SHORT}),
)
