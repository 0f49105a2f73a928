"""What every GGUF architecture file declares: how llama.cpp's tensors and hyper-parameters
map onto one of mlx-lm's model classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LLAMA_LAYER_TENSORS: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
"""llama.cpp's per-layer tensor names (`blk.N.<name>`) → Hugging Face's, for the families
laid out as Llama (`model.layers.N.<name>`)."""


def expert_tensors(block: str) -> dict[str, str]:
    """llama.cpp's mixture-of-experts tensors → mlx-lm's, for a sparse block at `block`
    (`mlp`, `block_sparse_moe`): the router and the experts' projections, stacked
    [n_expert, out, in] in the file as in mlx-lm's `SwitchGLU`."""
    return {
        "ffn_gate_inp": f"{block}.gate",
        "ffn_gate_exps": f"{block}.switch_mlp.gate_proj",
        "ffn_up_exps": f"{block}.switch_mlp.up_proj",
        "ffn_down_exps": f"{block}.switch_mlp.down_proj",
    }


GLOBAL_TENSORS: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
"""llama.cpp's model-wide tensor names → Hugging Face's."""


class ArchMetadata:
    """The `<arch>.*` hyper-parameters of one GGUF file, read with defaults, the names of
    its tensors, and the values of the small ones an architecture reads into its config."""

    def __init__(
        self,
        arch: str,
        metadata: Mapping[str, Any],
        tensor_names: Set[str],
        read_tensor: Callable[[str], np.ndarray] | None = None,
    ) -> None:
        self.arch = arch
        self.metadata = metadata
        self.tensor_names = tensor_names
        self._read_tensor = read_tensor

    def tensor(self, name: str) -> np.ndarray:
        """The values of the file's tensor `name` (one of `config_tensors`), as float32."""
        if self._read_tensor is None or name not in self.tensor_names:
            raise ValueError(f"GGUF tensor {name} is missing")
        return np.asarray(self._read_tensor(name), dtype=np.float32)

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, or `default`; ValueError when it is missing without one, or is a
        per-layer array (not supported)."""
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {self.arch}.{key} is missing")
        if isinstance(value, np.ndarray):
            raise ValueError(f"per-layer {self.arch}.{key} is not supported")
        return value

    def has(self, key: str) -> bool:
        """Whether the file sets `<arch>.<key>`."""
        return f"{self.arch}.{key}" in self.metadata


def llama_biases(hyper: ArchMetadata, _config: dict[str, Any]) -> dict[str, Any]:
    """The bias flags of mlx-lm's Llama-like classes: attention biases when the file has
    them, none in the MLP."""
    return {"attention_bias": "blk.0.attn_q.bias" in hyper.tensor_names, "mlp_bias": False}


def expert_config(hyper: ArchMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """The expert counts and sizes of mlx-lm's Qwen MoE classes."""
    return {
        "num_experts": int(hyper.get("expert_count")),
        "num_experts_per_tok": int(hyper.get("expert_used_count")),
        "moe_intermediate_size": int(
            hyper.get("expert_feed_forward_length", config["intermediate_size"])
        ),
    }


def _no_extras(_hyper: ArchMetadata, _config: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_fixes(_weights: dict[str, Any], _config: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture (`general.architecture`) read through an mlx-lm class."""

    name: str
    """The GGUF architecture name."""
    model_type: str
    """The mlx-lm module that builds it (`mlx_lm.models.<model_type>`)."""
    hf_architecture: str
    """The Hugging Face class name written into `config.json`."""
    default_rope_theta: float = 10000.0
    """RoPE base when the file does not say."""
    default_rms_eps: float = 1e-6
    """RMS-norm epsilon when the file does not say."""
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER_TENSORS))
    """Per-layer tensor names, llama.cpp's → Hugging Face's."""
    permuted_qk: bool = False
    """llama.cpp's converter interleaved the Q/K rows for its RoPE (the `llama` arch)."""
    norm_offset: float = 0.0
    """What llama.cpp's converter added to every norm weight (Gemma's `1 + w` norms: 1)."""
    extra_config: Callable[[ArchMetadata, dict[str, Any]], dict[str, Any]] = _no_extras
    """Architecture-specific `config.json` keys, from the hyper-parameters and the common
    config built so far."""
    fix_weights: Callable[[dict[str, Any], dict[str, Any]], None] = _no_fixes
    """Architecture-specific changes to the renamed weights, in place, given the config
    (fused projections the file keeps apart, shapes the class wants otherwise)."""
    config_tensors: frozenset[str] = frozenset()
    """Model-wide tensors that `extra_config` reads into the config (Phi-3's LongRoPE
    factors), not loaded as weights."""
    with_experts: GGUFArchitecture | None = None
    """What files of this name with experts (`<arch>.expert_count` > 0) are read as (a
    `llama` file with experts is a Mixtral)."""

    def for_file(self, metadata: Mapping[str, Any]) -> GGUFArchitecture:
        """This architecture, or its `with_experts` variant when the file has experts."""
        if self.with_experts is not None and metadata.get(f"{self.name}.expert_count", 0):
            return self.with_experts
        return self

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of the GGUF tensor `name`; None when it is unknown."""
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.layer_tensors[parts[2]]}.{parts[3]}"
        if len(parts) == 2 and parts[0] in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
        return None
