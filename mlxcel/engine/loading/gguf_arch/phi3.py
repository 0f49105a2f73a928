"""`phi3` GGUF files (Phi-3, Phi-3.5 mini, Phi-4 mini): mlx-lm's `phi3` class.

llama.cpp keeps Hugging Face's fused projections: `attn_qkv` is `qkv_proj` and `ffn_up`
is `gate_up_proj` (gate rows first); files with separate `attn_q/k/v` get them joined.
Q/K rows are not permuted (NeoX RoPE). Files with LongRoPE factors (`rope_factors_long`,
the 128k-context variants) are refused: their factors are tensors the loader does not
read into the config.
"""

from __future__ import annotations

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


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    if "rope_factors_long.weight" in hyper.tensor_names:
        raise ValueError("phi3 with LongRoPE factors (128k context) is not supported")
    per_head = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(hyper.get("rope.dimension_count", per_head))
    return {
        "partial_rotary_factor": rotary / per_head,
        "original_max_position_embeddings": int(
            hyper.get("rope.scaling.original_context_length", config["max_position_embeddings"])
        ),
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
)
