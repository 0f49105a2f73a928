"""`gemma2` GGUF files (Gemma 2 2B/9B/27B): mlx-lm's `gemma2` class.

As for Gemma 3, llama.cpp's converter stores every norm weight as `1 + w` and 1 is taken
off again. Attention and final logits are soft-capped (`attn_logit_softcapping`,
`final_logit_softcapping`; llama.cpp's defaults 50 and 30 when the file does not say);
queries are scaled by the head size, or by hidden / heads for the 46-layer 27B, as
llama.cpp does. mlx-lm's class attends globally in every layer: llama.cpp's 4096-token
sliding window on every other layer is not applied, which changes nothing for contexts
up to the window.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
)

GEMMA_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",  # before the MLP, as in Llama, but renamed
    "post_ffw_norm": "post_feedforward_layernorm",
}
"""Gemma 2 and 3's per-layer tensors: a norm before and after attention and the MLP."""

_LARGEST_LAYERS = 46  # Gemma 2 27B: queries scaled by hidden / heads, not the head size


def query_pre_attn_scalar(config: dict[str, Any], largest_layers: int) -> float:
    """What Gemma divides queries by (its square root): the head size, or hidden / heads
    for the largest model (`largest_layers` layers), as llama.cpp does."""
    per_head = config["hidden_size"] // config["num_attention_heads"]
    return float(per_head if config["num_hidden_layers"] == largest_layers else config["head_dim"])


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": float(hyper.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(hyper.get("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": query_pre_attn_scalar(config, _LARGEST_LAYERS),
    }


ARCHITECTURE = GGUFArchitecture(
    name="gemma2",
    model_type="gemma2",
    hf_architecture="Gemma2ForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-6,
    layer_tensors=GEMMA_LAYER_TENSORS,
    norm_offset=1.0,
    extra_config=_extras,
)
