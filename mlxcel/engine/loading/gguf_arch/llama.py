"""`llama` GGUF files (Llama 1-3, SmolLM2, Mistral 7B...): mlx-lm's `llama` class; those
with experts (Mixtral) through `mixtral`."""

from __future__ import annotations

from mlxcel.engine.loading.gguf_arch import mixtral
from mlxcel.engine.loading.gguf_arch.base import GGUFArchitecture, llama_biases

ARCHITECTURE = GGUFArchitecture(
    name="llama",
    model_type="llama",
    hf_architecture="LlamaForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-6,
    permuted_qk=True,
    extra_config=llama_biases,
    with_experts=mixtral.ARCHITECTURE,
)
