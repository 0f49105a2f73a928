"""`granitemoe` GGUF files (IBM Granite 3.x MoE, 1B-A400M / 3B-A800M): mlx-lm's
`granitemoe` class. Granite's four multipliers as in `granite`, and a sparse block per
layer: a router (`ffn_gate_inp`, softmax over the top-k logits) and stacked experts, whose
fused `input_linear` llama.cpp's converter stores split into `ffn_gate_exps` and
`ffn_up_exps`. Laid out and permuted as Llama."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch import granite
from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    ArchMetadata,
    GGUFArchitecture,
    expert_tensors,
)

_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    **expert_tensors("block_sparse_moe"),
    "ffn_gate_inp": "block_sparse_moe.router.layer",
}


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        **granite.ARCHITECTURE.extra_config(hyper, config),
        "num_local_experts": int(hyper.get("expert_count")),
        "num_experts_per_tok": int(hyper.get("expert_used_count")),
        "intermediate_size": int(
            hyper.get("expert_feed_forward_length", config["intermediate_size"])
        ),
    }


ARCHITECTURE = GGUFArchitecture(
    name="granitemoe",
    model_type="granitemoe",
    hf_architecture="GraniteMoeForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-6,
    layer_tensors=_LAYER_TENSORS,
    permuted_qk=True,
    extra_config=_extras,
)
