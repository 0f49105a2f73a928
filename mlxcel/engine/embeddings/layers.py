"""Small MLX building blocks shared by the encoder families: activations and masks."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from mlxcel.engine.errors import ModelLoadError

_ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "gelu": nn.gelu,
    "gelu_python": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_fast": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
    "tanh": mx.tanh,
}


def activation(name: str) -> Callable[[mx.array], mx.array]:
    """The activation function a Hugging Face config names."""
    try:
        return _ACTIVATIONS[name.lower()]
    except KeyError:
        raise ModelLoadError(f"unsupported activation {name!r}") from None


def key_padding_bias(mask: mx.array, dtype: mx.Dtype) -> mx.array:
    """Additive attention bias (B, 1, 1, T) that hides padded keys; `mask` is 1 for tokens."""
    hidden = mx.array(-1e9 if dtype == mx.float32 else -3e4, dtype=dtype)
    bias = mx.where(mask.astype(mx.bool_), mx.array(0.0, dtype=dtype), hidden)
    return bias[:, None, None, :]


def window_bias(length: int, window: int, dtype: mx.Dtype) -> mx.array:
    """Additive bias (1, 1, T, T) allowing keys within `window // 2` positions of the query."""
    pos = mx.arange(length)
    near = mx.abs(pos[:, None] - pos[None, :]) <= window // 2
    hidden = mx.array(-1e9 if dtype == mx.float32 else -3e4, dtype=dtype)
    return mx.where(near, mx.array(0.0, dtype=dtype), hidden)[None, None]


def split_heads(x: mx.array, heads: int) -> mx.array:
    """(B, T, H) → (B, heads, T, H / heads)."""
    b, t, h = x.shape
    return x.reshape(b, t, heads, h // heads).transpose(0, 2, 1, 3)


def merge_heads(x: mx.array) -> mx.array:
    """(B, heads, T, D) → (B, T, heads * D)."""
    b, n, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, n * d)
