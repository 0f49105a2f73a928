"""Mixtral: a `llama` GGUF file with experts (`llama.expert_count`), read through mlx-lm's
`mixtral` class. llama.cpp's converter stacks each layer's experts into `ffn_*_exps`
[n_expert, out, in] and permutes the Q/K rows as for Llama. Older files with one tensor
per expert (`ffn_gate.E`) are not read."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
    expert_tensors,
)

_LAYER_TENSORS = {**LLAMA_LAYER_TENSORS, **expert_tensors("block_sparse_moe")}


def _extras(hyper: ArchMetadata, _config: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_local_experts": int(hyper.get("expert_count")),
        "num_experts_per_tok": int(hyper.get("expert_used_count")),
    }


ARCHITECTURE = GGUFArchitecture(
    name="llama",
    model_type="mixtral",
    hf_architecture="MixtralForCausalLM",
    default_rope_theta=1000000.0,
    default_rms_eps=1e-5,
    layer_tensors=_LAYER_TENSORS,
    permuted_qk=True,
    extra_config=_extras,
)
