"""What a model on disk is, read without loading its weights: architecture and
quantization, for `mlxcel cache list/info` (a GGUF file's header, a directory's
`config.json`, a store entry's manifest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNKNOWN = "?"


@dataclass(frozen=True)
class ModelFacts:
    """A model's architecture (`gemma3`, `llama`...) and quantization (`Q4_K_M`, `4-bit`...)."""

    architecture: str = UNKNOWN
    quantization: str = UNKNOWN


def quantization_label(config: dict[str, Any]) -> str:
    """An MLX / Hugging Face `config.json`'s quantization: `N-bit`, or `none`."""
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and "bits" in quant:
        return f"{quant['bits']}-bit"
    return "none"


def describe_model(path: Path) -> ModelFacts:
    """The facts of the model at `path` (a `.gguf` file, or a directory with a converted
    store manifest or a `config.json`); `?` for what cannot be read."""
    try:
        if path.is_file() and path.suffix.lower() == ".gguf":
            from mlxcel.engine.loading.gguf import file_type, read_gguf_header

            header = read_gguf_header(path)
            arch = str(header.metadata.get("general.architecture", UNKNOWN))
            return ModelFacts(arch, file_type(header.metadata, header.tensors))
        manifest = path / "mlxcel.json"
        config = path / "config.json"
        data = json.loads(config.read_text()) if config.is_file() else {}
        if manifest.is_file():
            stored = json.loads(manifest.read_text())
            stored_arch = stored.get("architecture") or stored.get("kind") or data.get("model_type")
            quant = stored.get("quantization") or (quantization_label(data) if data else None)
            return ModelFacts(str(stored_arch or UNKNOWN), str(quant or UNKNOWN))
        if data:
            # A CTranslate2 Whisper export names no model_type; its alignment heads mark it.
            config_arch = data.get("model_type") or (
                "whisper" if "alignment_heads" in data else None
            )
            return ModelFacts(str(config_arch or UNKNOWN), quantization_label(data))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return ModelFacts()
