"""`gemma3` GGUF files (Gemma 3 text models, 270M to 27B): mlx-lm's `gemma3_text` class.

llama.cpp's converter stores every norm weight as `1 + w` (its RMS norm multiplies by the
weight, Gemma's by one plus it), so 1 is taken off again. Local (sliding-window) layers use
RoPE base `rope.freq_base_swa` (10000 when absent) and every `sliding_window_pattern`-th
layer (6 when absent) is global, as llama.cpp reads them; queries are scaled by the head
size, or by hidden / heads for the 62-layer 27B, as llama.cpp (and Gemma's reference) do.
"""

from __future__ import annotations

from typing import Any

from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture
from mlxcel.engine.loading.gguf_arch.gemma2 import GEMMA_LAYER_TENSORS, query_pre_attn_scalar

_LARGEST_LAYERS = 62  # Gemma 3 27B: queries scaled by hidden / heads, not the head size


def _extras(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    if hyper.has("final_logit_softcapping"):
        raise ValueError(
            "gemma3 with final logit soft-capping is not supported (mlx-lm's gemma3_text has none)"
        )
    window = int(hyper.get("attention.sliding_window", 0))
    return {
        "sliding_window": window if window > 0 else config["max_position_embeddings"],
        "sliding_window_pattern": int(hyper.get("attention.sliding_window_pattern", 6))
        if window > 0
        else 1,
        "rope_local_base_freq": float(hyper.get("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": query_pre_attn_scalar(config, _LARGEST_LAYERS),
    }


ARCHITECTURE = GGUFArchitecture(
    name="gemma3",
    model_type="gemma3_text",
    hf_architecture="Gemma3ForCausalLM",
    default_rope_theta=1000000.0,
    default_rms_eps=1e-6,
    layer_tensors=GEMMA_LAYER_TENSORS,
    norm_offset=1.0,
    extra_config=_extras,
)
