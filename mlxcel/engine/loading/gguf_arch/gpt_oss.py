"""`gpt-oss` GGUF files (OpenAI gpt-oss 20B/120B): mlx-lm's `gpt_oss` class.

Every projection has a bias, each attention head a learned sink (`attn_sinks`), every
other layer (the even ones) attends within a sliding window, and the experts' gate and up
projections are stored apart (llama.cpp's converter de-interleaves Hugging Face's fused
`gate_up_proj` as mlx-lm does). Real files store the experts as MXFP4, which loads bit
for bit into MLX's `mxfp4` quantization mode (`gguf_quants.to_mxfp4`).
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
)

_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",  # before the MLP
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    layers = config["num_hidden_layers"]
    return {
        "num_local_experts": int(hyper.get("expert_count")),
        "num_experts_per_tok": int(hyper.get("expert_used_count")),
        "intermediate_size": int(
            hyper.get("expert_feed_forward_length", config["intermediate_size"])
        ),
        "sliding_window": int(hyper.get("attention.sliding_window", 128)),
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
    }


def _sinks(weights: dict[str, Any], _config: dict[str, Any]) -> None:
    """`attn_sinks.weight` → mlx-lm's `sinks` parameter (no `.weight`)."""
    for key in [k for k in weights if k.endswith(".self_attn.sinks.weight")]:
        weights[key.removesuffix(".weight")] = weights.pop(key)


ARCHITECTURE = GGUFArchitecture(
    name="gpt-oss",
    model_type="gpt_oss",
    hf_architecture="GptOssForCausalLM",
    default_rope_theta=150000.0,
    default_rms_eps=1e-5,
    layer_tensors=_LAYER_TENSORS,
    extra_config=_extras,
    fix_weights=_sinks,
)
