"""`qwen2moe` GGUF files (Qwen1.5-MoE, Qwen2-57B-A14B): mlx-lm's `qwen2_moe` class.

Every layer is sparse: routed experts (`ffn_*_exps`, top-k of a softmax, not
renormalised) plus one shared expert (`ffn_*_shexp`) weighted by a sigmoid gate
(`ffn_gate_inp_shexp`, stored 1-D by some converters, a [1, hidden] row in mlx-lm).
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
    expert_config,
    expert_tensors,
)

_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    **expert_tensors("mlp"),
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        **expert_config(hyper, config),
        "shared_expert_intermediate_size": int(
            hyper.get("expert_shared_feed_forward_length", config["intermediate_size"])
        ),
    }


def _shared_gate_rows(weights: dict[str, Any], _config: dict[str, Any]) -> None:
    for key, value in weights.items():
        if key.endswith("shared_expert_gate.weight") and value.ndim == 1:
            weights[key] = value.reshape(1, -1)


ARCHITECTURE = GGUFArchitecture(
    name="qwen2moe",
    model_type="qwen2_moe",
    hf_architecture="Qwen2MoeForCausalLM",
    default_rope_theta=1000000.0,
    layer_tensors=_LAYER_TENSORS,
    extra_config=_extras,
    fix_weights=_shared_gate_rows,
)
