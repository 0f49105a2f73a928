"""`granite` GGUF files (IBM Granite 3.x dense): mlx-lm's `granite` class.

Granite scales where Llama does not, and the file says by how much: the embeddings
(`embedding_scale`), each residual branch (`residual_scale`), the attention scores
(`attention.scale`, in place of 1/sqrt(head size)) and the logits (divided by
`logit_scale`). Laid out and permuted as Llama.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture, llama_biases


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    head = config["hidden_size"] // config["num_attention_heads"]
    return {
        "embedding_multiplier": float(hyper.get("embedding_scale", 1.0)),
        "residual_multiplier": float(hyper.get("residual_scale", 1.0)),
        "attention_multiplier": float(hyper.get("attention.scale", head**-0.5)),
        "logits_scaling": float(hyper.get("logit_scale", 1.0)),
        **llama_biases(hyper, config),
    }


ARCHITECTURE = GGUFArchitecture(
    name="granite",
    model_type="granite",
    hf_architecture="GraniteForCausalLM",
    default_rope_theta=10000.0,
    default_rms_eps=1e-5,
    permuted_qk=True,
    extra_config=_extras,
)
