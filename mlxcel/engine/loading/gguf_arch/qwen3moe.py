"""`qwen3moe` GGUF files (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): mlx-lm's
`qwen3_moe` class. Q/K norms as in Qwen3; every layer sparse, the top-k expert weights
renormalised to sum to one, as llama.cpp computes them."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
    expert_config,
    expert_tensors,
)

_LAYER_TENSORS = {**LLAMA_LAYER_TENSORS, **expert_tensors("mlp")}


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        **expert_config(hyper, config),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


ARCHITECTURE = GGUFArchitecture(
    name="qwen3moe",
    model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    default_rope_theta=1000000.0,
    layer_tensors=_LAYER_TENSORS,
    extra_config=_extras,
)
