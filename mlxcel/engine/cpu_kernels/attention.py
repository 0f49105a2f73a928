"""Decode-step attention on mlxcel's CPU kernel.

mlx-lm's models call `mx.fast.scaled_dot_product_attention`; on the CPU backend MLX runs
it as a chain of about ten ops, which for one decode row costs more than the arithmetic
(85 us a layer on a 2-core box for SmolLM2's 9 heads). `use_attention_kernel` wraps that
function once per process: float32 calls on the CPU with at most `ATTENTION_MAX_ROWS`
query rows (decode steps, batched decode, speculative verify rounds), no attention sinks
and a mask that is none, "causal", or a boolean / additive array go to the kernel's
one-op attention; everything else (prefill, other devices and dtypes) reaches MLX's own
function unchanged. Each query row is reduced over the keys in order, so keys a mask
removes (a batch's left padding) change nothing: a row's result is the same alone or in
a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx

# Up to this many query rows per call the one-op kernel wins; prefill (more rows) stays on
# MLX's GEMM-based path.
ATTENTION_MAX_ROWS = 16

_NO_MASK, _CAUSAL, _ADDITIVE, _BOOLEAN = 0, 1, 2, 3


def _kernel_mask(mask: Any, q: mx.array, k: mx.array) -> tuple[int, mx.array | None] | None:
    """(mask kind, mask broadcast to [B, Hq, L, S]) for the kernel, or None for MLX's path."""
    if mask is None:
        return _NO_MASK, None
    if isinstance(mask, str):
        return (_CAUSAL, None) if mask == "causal" else None
    if not isinstance(mask, mx.array):
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
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
            and q.shape[2] <= ATTENTION_MAX_ROWS
            and q.dtype == mx.float32
            and k.dtype == mx.float32
            and v.dtype == mx.float32
            and k.ndim == 4
            and k.shape == v.shape
            and k.shape[0] == q.shape[0]
            and k.shape[3] == q.shape[3]
            and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0
            and mx.default_device() == mx.cpu
        ):
            kind = _kernel_mask(mask, q, k)
            if kind is not None:
                out: mx.array = kernels.attention(q, k, v, float(scale), kind[0], kind[1])
                return out
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)

    scaled_dot_product_attention.mlxcel_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def use_attention_kernel(kernels: ModuleType) -> bool:
    """Route few-row CPU attention to the kernel (see module doc). Idempotent; returns
    whether the wrapper is in place."""
    current = mx.fast.scaled_dot_product_attention
    if not hasattr(current, "mlxcel_original"):
        mx.fast.scaled_dot_product_attention = _wrap(kernels, current)
    return True
