"""Quantized layers that run their small matmuls on mlxcel's CPU kernel.

`use_cpu_kernels(model)` swaps every affine 4/8-bit `QuantizedLinear` (and the
`QuantizedEmbedding` a tied LM head reads through `as_linear`) for a subclass that sends
matmuls of up to `KERNEL_MAX_ROWS` rows (decode steps, batched decode, speculative verify
rounds) to the kernel. Larger matmuls (prefill) use a float32 copy of the weight when one
was made (faster there: BLAS GEMM), else the kernel as well. The kernel computes every row
with the same order of operations whatever the number of rows, so a sequence decodes to
the same logits alone or in a batch of up to `KERNEL_MAX_ROWS`.

Float32 models get the same treatment for their `nn.Linear` layers (and a tied LM head):
matmuls of up to `DENSE_MAX_ROWS` rows run on the kernel's float32 path (`dense_matmul`,
each weight row read once for all rows, where a BLAS GEMM packs the whole matrix first),
larger ones on BLAS as before (`use_dense_kernels`).

When the kernel rounds 4-bit layers' activations to int8 (AVX-512 VNNI), the float32 copy
is fed the same rounded activations (the kernel's `round_int8` op), so a prompt gets the
same numbers (up to float32 summation order) whether its rows go to the kernel (prefilled
alone) or to BLAS (prefilled with other prompts, more rows).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Above this many rows a float32 GEMM beats the kernel (measured on a 2-core AVX-512 box:
# kernel 1.2x at 16 rows, 0.8-0.9x at 64).
KERNEL_MAX_ROWS = 16
# Float32 weights: up to this many rows the kernel's float32 path beats OpenBLAS's GEMM
# (bench/cpu_path.py, 2-core AVX-512 box).
DENSE_MAX_ROWS = 8


def _kernel_matmul(
    kernels: ModuleType, x: mx.array, layer: Any, dense: mx.array | None
) -> mx.array:
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if dense is not None and rows > KERNEL_MAX_ROWS:
        if layer.bits == 4 and kernels.int8():
            x = kernels.round_int8(x)
        return x @ dense.T
    out: mx.array = kernels.quantized_matmul(
        x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
    )
    return out


class KernelQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` whose matmul runs on mlxcel's CPU kernel (see module doc)."""

    kernels: ModuleType
    dense: mx.array | None

    def __call__(self, x: mx.array) -> mx.array:
        y = _kernel_matmul(self.kernels, x, self, self.get("dense"))
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied LM head) runs on the kernel."""

    kernels: ModuleType

    def as_linear(self, x: mx.array) -> mx.array:
        return _kernel_matmul(self.kernels, x, self, self.get("dense"))


class KernelLinear(nn.Linear):
    """`nn.Linear` (float32) whose matmuls of up to `DENSE_MAX_ROWS` rows run on the kernel."""

    kernels: ModuleType

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or x.size > DENSE_MAX_ROWS * x.shape[-1]:
            return super().__call__(x)
        y: mx.array = self.kernels.dense_matmul(x, self["weight"])
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelEmbedding(nn.Embedding):
    """`nn.Embedding` (float32) whose `as_linear` (a tied LM head) runs on the kernel for up
    to `DENSE_MAX_ROWS` rows."""

    kernels: ModuleType

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or x.size > DENSE_MAX_ROWS * x.shape[-1]:
            return super().as_linear(x)
        out: mx.array = self.kernels.dense_matmul(x, self["weight"])
        return out


class KernelRoPE(nn.RoPE):
    """`nn.RoPE` on the kernel's rope (float32 [B, H, L, D] input): the angles computed once
    per position for every head, where MLX's CPU rope computes them per element."""

    kernels: ModuleType

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype != mx.float32 or x.ndim != 4:
            return super().__call__(x, offset)  # type: ignore[arg-type]
        start = offset if isinstance(offset, mx.array) else mx.array(int(offset))
        out: mx.array = self.kernels.rope(
            x, int(self.dims), bool(self.traditional), float(self.base), float(self.scale), start
        )
        return out


def use_rope_kernel(model: nn.Module, kernels: ModuleType) -> int:
    """Switch `model`'s plain `nn.RoPE` modules (not the scaled variants) to `KernelRoPE`.
    Returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.RoPE:
            module.__class__ = KernelRoPE
            module.kernels = kernels
            changed += 1
    return changed


def use_dense_kernels(model: nn.Module, kernels: ModuleType) -> int:
    """Switch `model`'s float32 `nn.Linear` / `nn.Embedding` layers whose input width is a
    multiple of the kernel's SIMD width to `KernelLinear` / `KernelEmbedding`. Returns how
    many layers changed."""
    width = int(kernels.simd_width)
    changed = 0
    for _, module in model.named_modules():
        kind = type(module)
        if kind not in (nn.Linear, nn.Embedding):
            continue
        weight = module["weight"]
        if weight.dtype != mx.float32 or weight.ndim != 2 or weight.shape[1] % width:
            continue
        module.__class__ = KernelLinear if kind is nn.Linear else KernelEmbedding
        module.kernels = kernels
        changed += 1
    return changed


def supports(module: Any) -> bool:
    """Whether the kernel can run this quantized layer."""
    if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return False
    if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
        return False
    bits, group_size = int(module.bits), int(module.group_size)
    in_features = int(module.weight.shape[-1]) * 32 // bits
    return bits in (4, 8) and group_size % 32 == 0 and in_features % group_size == 0


def use_cpu_kernels(model: nn.Module, kernels: ModuleType, *, dense: bool) -> int:
    """Switch the supported quantized layers of `model` to the kernel; with `dense`, also
    keep a float32 copy of each weight for prefill. Returns how many layers changed."""
    changed = 0
    for _, module in model.named_modules():
        if not supports(module):
            continue
        scales = module["scales"]
        if scales.dtype != mx.float32:
            module["scales"] = scales.astype(mx.float32)
            module["biases"] = module["biases"].astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            module.__class__ = KernelQuantizedEmbedding
        else:
            module.__class__ = KernelQuantizedLinear
        module.kernels = kernels
        if dense:
            module["dense"] = mx.dequantize(
                module["weight"],
                module["scales"],
                module["biases"],
                group_size=module.group_size,
                bits=module.bits,
            ).astype(mx.float32)
        changed += 1
    if changed:
        mx.eval(model.parameters())
    return changed
