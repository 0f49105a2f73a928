"""`smollm3` GGUF files (SmolLM3-3B): mlx-lm's `smollm3` class, Llama with no RoPE in
every fourth layer. llama.cpp fixes that step at 4 in its code (the file has no key for
it), as mlx-lm's default `no_rope_layer_interval` does. Laid out and permuted as Llama."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture, llama_biases

_NO_ROPE_STEP = 4  # llama.cpp: hparams.n_no_rope_layer_step = 4 for LLM_ARCH_SMOLLM3


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "no_rope_layer_interval": _NO_ROPE_STEP,
        **llama_biases(hyper, config),
    }


ARCHITECTURE = GGUFArchitecture(
    name="smollm3",
    model_type="smollm3",
    hf_architecture="SmolLM3ForCausalLM",
    default_rope_theta=5000000.0,
    default_rms_eps=1e-6,
    permuted_qk=True,
    extra_config=_extras,
)
