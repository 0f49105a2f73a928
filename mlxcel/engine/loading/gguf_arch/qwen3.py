"""`qwen3` GGUF files: mlx-lm's `qwen3` class (q/k norms)."""

from __future__ import annotations

from mlxcel.engine.loading.gguf_arch.base import GGUFArchitecture

ARCHITECTURE = GGUFArchitecture(
    name="qwen3",
    model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    default_rope_theta=1000000.0,
)
