"""Build an MLX encoder from a Hugging Face directory: config, safetensors, name mapping."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxcel.engine.embeddings.bert import BertEncoder, bert_weight_name
from mlxcel.engine.embeddings.config import EncoderConfig
from mlxcel.engine.embeddings.modernbert import ModernBertEncoder, modernbert_weight_name
from mlxcel.engine.errors import ModelLoadError

_HALF = (mx.float16, mx.bfloat16)


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors weight files of a model directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if (path / "pytorch_model.bin").is_file():
            raise ModelLoadError(
                f"{path.name}: only pytorch_model.bin found; mlxcel reads safetensors weights "
                "(convert the checkpoint to model.safetensors)"
            )
        raise ModelLoadError(f"{path.name}: no *.safetensors weights")
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor of the directory's safetensors files."""
    weights: dict[str, mx.array] = {}
    for file in safetensors_files(path):
        try:
            loaded = mx.load(str(file))
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path.name}: cannot read {file.name} ({exc})") from exc
        assert isinstance(loaded, dict)
        weights.update(loaded)
    return weights


def _dtype(weights: dict[str, mx.array], dtype: str) -> mx.Dtype | None:
    """The dtype to cast to: float32 for half weights on the CPU unless told to keep them."""
    if dtype == "keep":
        return None
    if dtype == "float32":
        return mx.float32
    on_cpu = mx.default_device() == mx.cpu
    half = any(v.dtype in _HALF for v in weights.values())
    return mx.float32 if on_cpu and half else None


def build_encoder(
    config: EncoderConfig,
    weights: dict[str, mx.array],
    *,
    name: str = "model",
    dtype: str = "auto",
) -> nn.Module:
    """An encoder module with `weights` (Hugging Face names) loaded; checks nothing is missing."""
    mapper: Callable[[str], str | None]
    if config.family == "modernbert":
        mapper = modernbert_weight_name
        module: nn.Module = ModernBertEncoder(config)
    else:
        mapper = bert_weight_name
        has_pooler = any(".pooler." in f".{k}" for k in weights)
        module = BertEncoder(config, with_pooler=has_pooler)
    expected = {str(pair[0]) for pair in tree_flatten(module.parameters())}
    mapped: dict[str, Any] = {}
    for key, value in weights.items():
        target = mapper(key)
        if target is not None and target in expected:
            mapped[target] = value
    return load_into(module, mapped, name=name, dtype=dtype)


def load_into(
    module: nn.Module, weights: dict[str, mx.array], *, name: str = "model", dtype: str = "auto"
) -> nn.Module:
    """`module` with `weights` (its own parameter names) loaded, cast per `dtype`, evaluated.

    ModelLoadError names the parameters the weights lack.
    """
    expected = {str(pair[0]) for pair in tree_flatten(module.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        shown = ", ".join(missing[:3]) + (" …" if len(missing) > 3 else "")
        raise ModelLoadError(f"{name}: weights missing for {shown}")
    cast = _dtype(weights, dtype)
    items = [
        (k, v.astype(cast) if cast is not None else v) for k, v in weights.items() if k in expected
    ]
    try:
        module.load_weights(items, strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{name}: {str(exc).splitlines()[0]}") from exc
    module.eval()
    mx.eval(module.parameters())
    return module
