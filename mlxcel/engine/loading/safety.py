"""Refuse models that need Python code shipped with them: mlxcel never runs it."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import ModelLoadError

# The JSON files of a model directory through which a model can ask for its own code.
CONFIG_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)

_NEVER = "mlxcel never runs code shipped with a model"


class UnsafeModelError(ModelLoadError):
    """A model needs code shipped with it, or a load asked to run such code."""


def check_model_dir(path: Path, *, name: str | None = None) -> None:
    """Raise UnsafeModelError if the model in `path` needs code shipped with it.

    Refused: an `auto_map` in a config file, a config value naming a `.py` file (or a
    module that is a `.py` file in the directory), and a `trust_remote_code` request.
    """
    path = Path(path)
    label = name or model_label(path)
    modules = {p.stem for p in path.glob("*.py")}
    for file_name in CONFIG_FILES:
        config = _read_json(path / file_name)
        if config is None:
            continue
        for key, value in _walk(config):
            if key == "auto_map" and value:
                reason = f"auto_map in {file_name}"
            elif key == "trust_remote_code" and value:
                reason = f"trust_remote_code in {file_name}"
            elif isinstance(value, str) and _names_code(value, modules):
                reason = f"{key} = {value!r} in {file_name}"
            else:
                continue
            raise UnsafeModelError(f"model {label} needs custom code ({reason}); {_NEVER}")


def check_loader_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Raise UnsafeModelError for loader options that would run a model's own code.

    Refuses `trust_remote_code=True` and `model_file`, also inside nested option dicts
    (such as mlx-lm's `tokenizer_config` and `model_config`).
    """
    for key, value in kwargs.items():
        if key == "trust_remote_code" and value:
            raise UnsafeModelError(f"trust_remote_code=True is refused; {_NEVER}")
        if key == "model_file" and value is not None:
            raise UnsafeModelError(f"model_file={value!r} is refused; {_NEVER}")
        if isinstance(value, Mapping):
            check_loader_kwargs(value)


def model_label(path: Path) -> str:
    """A name for the model in `path`: "org/name" for a Hugging Face cache snapshot."""
    parent = path.parent
    if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
        return parent.parent.name[len("models--") :].replace("--", "/")
    return path.name or str(path)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # an unreadable config cannot ask for code; the loader reports it


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a JSON document, depth first; list items keep their key."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield str(k), v
            yield from _walk(v, str(k))
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, (dict, list)):
                yield key, item
            yield from _walk(item, key)


def _names_code(value: str, modules: set[str]) -> bool:
    """Whether a config string points at Python code: "x.py", or "module.Class" (maybe
    "org/repo--module.Class") where module.py is in the model directory."""
    if len(value) > 256 or any(c.isspace() for c in value):
        return False
    if value.endswith(".py"):
        return True
    reference = value.rsplit("--", 1)[-1]
    module, dot, _ = reference.partition(".")
    return bool(dot) and module in modules
