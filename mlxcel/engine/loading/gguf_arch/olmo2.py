"""`olmo2` GGUF files (OLMo 2 1B-32B): mlx-lm's `olmo2` class.

No norm before attention or the MLP: each block's output is normed (`post_attention_norm`,
`post_ffw_norm`) before the residual add, and Q/K are RMS-normed over all heads at once
(`attn_q_norm` has hidden-size weights). Q/K rows are not permuted (NeoX RoPE).
"""

from __future__ import annotations

from mlxcel.engine.loading.gguf_arch.base import (
    LLAMA_LAYER_TENSORS,
    GGUFArchitecture,
    llama_biases,
)

_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


ARCHITECTURE = GGUFArchitecture(
    name="olmo2",
    model_type="olmo2",
    hf_architecture="Olmo2ForCausalLM",
    default_rope_theta=500000.0,
    default_rms_eps=1e-6,
    layer_tensors=_LAYER_TENSORS,
    extra_config=llama_biases,
)
