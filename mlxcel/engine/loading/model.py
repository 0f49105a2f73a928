"""What a loaded text model is: the network, its tokenizer and facts about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a loaded model that the CLI and the server report."""

    name: str
    source: str  # "gguf" | "mlx" | "hf-cache" | "default"
    path: Path
    architecture: str
    context_length: int
    quantization: str = "none"
    family: str = "generic"
    num_parameters: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedModel:
    """A text model ready for the engine: `model(inputs, cache=...) -> logits`."""

    model: Any  # an mlx-lm style nn.Module
    tokenizer: Tokenizer
    info: ModelInfo
