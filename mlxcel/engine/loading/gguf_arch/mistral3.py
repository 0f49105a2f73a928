"""`mistral3` GGUF files (Ministral 3 and the Mistral Small text models llama.cpp names so):
mlx-lm's `ministral3` class, Llama laid out and permuted as llama's, plus YaRN RoPE and
Llama 4's attention temperature.

llama.cpp reads the YaRN keys (`rope.scaling.*`: factor, original context, beta fast/slow
and `yarn_log_multiplier`, the Hugging Face `mscale_all_dim`, with `mscale` taken as 1)
and scales the queries by 1 + beta * ln(1 + floor(pos / original context)) with beta
`attention.temperature_scale`; mlx-lm's class does both from `rope_parameters`. Files
without YaRN get plain RoPE and beta 0 (no temperature). What neither side maps (an
explicit YaRN attention or extrapolation factor, experts) is refused.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    if int(hyper.get("expert_count", 0)):
        raise ValueError("mistral3 with experts is not supported")
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor"):
        if float(hyper.get(key, 1.0)) != 1.0:
            raise ValueError(f"mistral3 {key} {hyper.get(key):g} is not supported")
    context = config["max_position_embeddings"]
    parameters: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": config["rope_theta"],
        "original_max_position_embeddings": int(
            hyper.get("rope.scaling.original_context_length", context)
        ),
        "llama_4_scaling_beta": float(hyper.get("attention.temperature_scale", 0.0)),
    }
    if str(hyper.get("rope.scaling.type", "none")) == "yarn":
        parameters |= {
            "rope_type": "yarn",
            "factor": float(hyper.get("rope.scaling.factor")),
            "beta_fast": float(hyper.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(hyper.get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": 1.0,
            "mscale_all_dim": float(hyper.get("rope.scaling.yarn_log_multiplier", 0.0)),
        }
    return {"rope_parameters": parameters}


ARCHITECTURE = GGUFArchitecture(
    name="mistral3",
    model_type="ministral3",
    hf_architecture="Ministral3ForCausalLM",
    default_rope_theta=1000000.0,
    default_rms_eps=1e-5,
    permuted_qk=True,
    extra_config=_extras,
)
