"""Loading an mlx-vlm checkpoint directory into a `LoadedVisionModel`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.loading.materialize import materialize
from mlxcel.engine.loading.model import ModelInfo
from mlxcel.engine.tokenizer import Tokenizer
from mlxcel.engine.vision.detect import NATIVE_VIDEO_FAMILIES, is_vision_config, vision_modalities

DEFAULT_CONTEXT_LENGTH = 4096


@dataclass
class LoadedVisionModel:
    """An mlx-vlm model with its processor, our tokenizer over it, and what it accepts."""

    model: Any
    processor: Any
    tokenizer: Tokenizer
    info: ModelInfo
    modalities: frozenset[str]
    native_video: bool


def read_config(path: Path) -> dict[str, Any] | None:
    """The directory's config.json, or None when it has none (or it is not JSON)."""
    try:
        value = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_vision_model_dir(path: Path) -> bool:
    """Whether `path` is a model directory whose config declares image/video/audio inputs."""
    config = read_config(path) if path.is_dir() else None
    return config is not None and is_vision_config(config)


def vision_model_path(ref: str | None) -> Path | None:
    """The directory `ref` names (a path or a cached Hugging Face repo id) when it holds a
    vision (or audio) language model, else None."""
    if not ref:
        return None
    path = Path(os.path.expanduser(ref))
    if not path.is_dir():
        from mlxcel.engine.loading.hf_cache import looks_like_repo_id, resolve_hf_repo

        if path.exists() or not looks_like_repo_id(ref):
            return None
        try:  # only what is cached: the text loader downloads (once) when allowed
            path = resolve_hf_repo(ref, allow_download=False)
        except ValueError:
            return None
    return path if is_vision_model_dir(path) else None


def load_vision_model(path: Path, *, name: str, source: str = "mlx") -> LoadedVisionModel:
    """Load the mlx-vlm checkpoint in `path` (no code shipped with a model ever runs)."""
    from mlxcel.engine.loading.safety import check_model_dir
    from mlxcel.engine.loading.weight_files import check_safetensors

    check_model_dir(path)
    config = read_config(path)
    if config is None:
        raise ModelLoadError(f"{name}: no readable config.json")
    check_safetensors(path, name=name)
    try:
        from mlx_vlm import load as vlm_load
    except ImportError as exc:
        raise ModelLoadError(
            f"{name}: vision models need mlx-vlm (pip install 'mlxcel[vision]')"
        ) from exc
    try:
        model, processor = vlm_load(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{name}: mlx-vlm cannot load this model: {first}") from exc
    materialize(model)
    hf_tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]
    template = getattr(processor, "chat_template", None)
    tokenizer = Tokenizer(
        hf_tokenizer,
        eos_token_ids=eos_ids,
        chat_template=template if isinstance(template, str) else None,
    )
    family = str(config.get("model_type", "unknown"))
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    context = int(
        (text or {}).get("max_position_embeddings")
        or config.get("max_position_embeddings")
        or DEFAULT_CONTEXT_LENGTH
    )
    info = ModelInfo(
        name=name,
        source=source,
        path=path,
        architecture=family,
        context_length=context,
        family="vlm",
        extra={"backend": "mlx-vlm"},
    )
    return LoadedVisionModel(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        info=info,
        modalities=vision_modalities(config),
        native_video=family in NATIVE_VIDEO_FAMILIES,
    )
