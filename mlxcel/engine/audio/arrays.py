"""Evaluate every array a model holds, including private ones that are not parameters.

MLX streams belong to threads: a lazy array built on one thread cannot be evaluated on
another. mlx-whisper and mlx-audio compute some constants at construction (positional
tables, masks, windows) without evaluating them, so a model loaded on one thread (the audio
worker) would fail on another (a CLI, a test) unless everything is evaluated at load.
"""

from __future__ import annotations

from typing import Any


def evaluate_all(model: Any) -> None:
    """`mx.eval` on all arrays of `model` (parameters and private constants)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    keep = (mx.array, nn.Module, list, tuple, dict)
    arrays = model.filter_and_map(lambda _module, _key, value: isinstance(value, keep))
    flat: Any = tree_flatten(arrays)
    mx.eval([value for _name, value in flat if isinstance(value, mx.array)])
