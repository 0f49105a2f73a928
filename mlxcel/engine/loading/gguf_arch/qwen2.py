"""`qwen2` GGUF files (Qwen2, Qwen2.5): mlx-lm's `qwen2` class (q/k/v biases)."""

from __future__ import annotations

from mlxcel.engine.loading.gguf_arch.base import GGUFArchitecture

ARCHITECTURE = GGUFArchitecture(
    name="qwen2",
    model_type="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    default_rope_theta=1000000.0,
)
