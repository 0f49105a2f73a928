"""`llama` GGUF files (Llama 1-3, SmolLM2, Mistral 7B...): mlx-lm's `llama` class."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture


def _extras(hyper: ArchMetadata, _config: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in hyper.tensor_names, "mlp_bias": False}


ARCHITECTURE = GGUFArchitecture(
    name="llama",
    model_type="llama",
    hf_architecture="LlamaForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-6,
    permuted_qk=True,
    extra_config=_extras,
)
