"""Evaluating every array a loaded model holds before another thread runs it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def materialize(model: nn.Module) -> None:
    """Evaluate every array of `model`: its parameters and the arrays its modules keep outside
    them (the `_freqs` of mlx-lm's YaRN, LongRoPE and Llama 3 RoPE modules, Gemma 4's audio
    timescales). Left lazy, such an array is a graph built on the loading thread, which MLX
    cannot evaluate on the engine's thread ("There is no Stream(cpu, 0) in current thread");
    every loader calls this last.

    MLX's global random key is evaluated too: each random initializer of the module tree
    (weights the loaded ones then replace) advanced it lazily, and left so its graph keeps
    every step, about 1 MiB of native memory per model built, never freed (a router that
    switches models grew by that much at every load)."""
    arrays: list[mx.array] = []
    for module in model.modules():
        arrays += [v for v in (*module.values(), *vars(module).values()) if isinstance(v, mx.array)]
    mx.eval(model.parameters(), arrays, mx.random.state)
