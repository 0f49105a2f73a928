"""CPU attention on mlxcel's kernel, for every number of query rows.

mlx-lm's models call `mx.fast.scaled_dot_product_attention`; on the CPU backend MLX runs
it as a chain of about ten ops, which for one decode row costs more than the arithmetic
(85 us a layer on a 2-core box for SmolLM2's 9 heads) and for a prefill is 20-70x slower
than the kernel (9 query heads over 3 key heads, 64 values a head, causal: 512 rows 0.3-0.6 s
against 4-12 ms, 2048 rows 3.5-4.8 s against 0.15-0.23 s). `use_attention_kernel` wraps that
function once per process: CPU calls with float32 queries, keys and values of float32,
float16 or bfloat16 (the KV cache's type, `-ctk/-ctv`, read in place: no float32 copy), no
attention sinks and a mask that is none, "causal", or a boolean / additive array go to the
kernel's one-op attention, whatever their number of query rows (decode steps, batched
decode, speculative verify rounds, prefill chunks); everything else (other devices and
dtypes, values narrower than keys) reaches MLX's own function unchanged. mlx-lm's
`quantized_scaled_dot_product_attention` (the attention of a `q8_0`/`q4_0` cache: 8 or 4
bits, float16 scales and biases in groups of 32 or 64) is wrapped the same way: the kernel
reads the packed rows in place where mlx-lm runs two quantized matmuls.

Each query row is reduced over its keys in order, on its own: keys a mask removes (a
batch's left padding) change nothing, and a row's result does not depend on the other rows
of its call. A prompt token's attention is therefore the same whether the prompt was
prefilled at once, in chunks, or after a partial or full prompt-cache hit; sending prefill
to MLX's function (as up to 16 rows once did) made greedy output depend on the split.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx

_NO_MASK, _CAUSAL, _ADDITIVE, _BOOLEAN = 0, 1, 2, 3
_KV_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


def _kernel_mask(mask: Any, q: mx.array, n_keys: int) -> tuple[int, mx.array | None] | None:
    """(mask kind, mask broadcast to [B, Hq, L, S]) for the kernel, or None for MLX's path."""
    if mask is None:
        return _NO_MASK, None
    if isinstance(mask, str):
        return (_CAUSAL, None) if mask == "causal" else None
    if not isinstance(mask, mx.array):
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], n_keys)
    try:
        if mask.dtype == mx.bool_:
            return _BOOLEAN, mx.broadcast_to(mask, shape)
        return _ADDITIVE, mx.broadcast_to(mask.astype(mx.float32), shape)
    except ValueError:
        return None


def _wrap(kernels: ModuleType, original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        *,
        scale: float,
        mask: Any = None,
        sinks: mx.array | None = None,
        stream: Any = None,
        **kwargs: Any,
    ) -> mx.array:
        if (
            sinks is None
            and stream is None
            and not kwargs
            and q.ndim == 4
            and q.dtype == mx.float32
            and k.dtype in _KV_FLOATS
            and v.dtype == k.dtype
            and k.ndim == 4
            and k.shape == v.shape
            and k.shape[0] == q.shape[0]
            and k.shape[3] == q.shape[3]
            and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0
            and mx.default_device() == mx.cpu
        ):
            kind = _kernel_mask(mask, q, k.shape[2])
            if kind is not None:
                out: mx.array = kernels.attention(q, k, v, float(scale), kind[0], kind[1])
                return out
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)

    scaled_dot_product_attention.mlxcel_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _wrap_quantized(
    kernels: ModuleType, original: Callable[..., mx.array]
) -> Callable[..., mx.array]:
    def quantized_scaled_dot_product_attention(
        queries: mx.array,
        q_keys: tuple[mx.array, mx.array, mx.array],
        q_values: tuple[mx.array, mx.array, mx.array],
        scale: float,
        mask: Any,
        group_size: int = 64,
        bits: int = 8,
    ) -> mx.array:
        if (
            bits in (4, 8)
            and group_size in (32, 64)
            and queries.ndim == 4
            and queries.dtype == mx.float32
            and all(a.dtype == mx.float16 for a in (*q_keys[1:], *q_values[1:]))
            and mx.default_device() == mx.cpu
        ):
            kind = _kernel_mask(mask, queries, q_keys[0].shape[2])
            if kind is not None:
                out: mx.array = kernels.quantized_attention(
                    queries, *q_keys, *q_values, float(scale), kind[0], kind[1], bits, group_size
                )
                return out
        return original(queries, q_keys, q_values, scale, mask, group_size, bits)

    quantized_scaled_dot_product_attention.mlxcel_original = original  # type: ignore[attr-defined]
    return quantized_scaled_dot_product_attention


def use_attention_kernel(kernels: ModuleType) -> bool:
    """Route CPU attention to the kernel (see module doc). Idempotent; returns whether the
    wrappers are in place."""
    from mlx_lm.models import base

    current = mx.fast.scaled_dot_product_attention
    if not hasattr(current, "mlxcel_original"):
        mx.fast.scaled_dot_product_attention = _wrap(kernels, current)
    quantized = base.quantized_scaled_dot_product_attention
    if not hasattr(quantized, "mlxcel_original") and hasattr(kernels, "quantized_attention"):
        base.quantized_scaled_dot_product_attention = _wrap_quantized(kernels, quantized)
    return True
