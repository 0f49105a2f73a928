"""A model's network built from its configuration with no weights read, for the checks that
need its classes (its KV cache layers, its head size) before a server opens its port."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.nn as nn

from mlxcel.engine.loading.default_model import default_model_path

_CANNOT_BUILD = (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError)


def model_skeleton(ref: str | None) -> nn.Module | None:
    """The network `ref` names (as `load_model` takes it; None: the embedded default), its
    arrays never evaluated: a GGUF file's from its header, a directory's (or a cached Hugging
    Face repo's) through mlx-lm's lazy load, which reads only the weight files' headers. None
    when it cannot be built here (a repo not in the cache, a file the loader will refuse):
    the load then decides."""
    try:
        if not ref:
            return _from_gguf(default_model_path())
        path = Path(os.path.expanduser(ref))
        if path.is_file():
            return _from_gguf(path)
        if not path.is_dir():
            from mlxcel.engine.loading.hf_cache import resolve_hf_repo

            path = resolve_hf_repo(ref, allow_download=False)
        return _from_directory(path)
    except _CANNOT_BUILD:
        return None


def _from_gguf(path: Path) -> nn.Module:
    from mlxcel.engine.loading.gguf import gguf_config, model_for_config

    return model_for_config(gguf_config(path)[2])


def _from_directory(path: Path) -> nn.Module:
    from mlx_lm.utils import load_model

    from mlxcel.engine.loading.safety import check_model_dir

    check_model_dir(path)  # no code shipped with a model runs
    model, _ = load_model(path, lazy=True)
    return model
