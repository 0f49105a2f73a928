"""Quantized layers that run their matmuls on mlxcel's CPU kernel.

`use_cpu_kernels(model)` swaps every affine 4/8-bit `QuantizedLinear` (and the
`QuantizedEmbedding` a tied LM head reads through `as_linear`) for a subclass on the kernel.

Where the CPU has AVX-512 VNNI (the int8 path), a 2- to 8-bit linear layer whose scales
and biases are exact in float16 (GGUF's always are) becomes a `KernelPackedLinear`: its
weight is repacked once into the kernel's int8 tiles (`pack_int8`: every 16 rows stored
block by block with their float16 block scales, one sequential stream; 4-bit codes as
nibbles, 5-bit ones (GGUF's Q5_0/Q5_1) as nibbles and a plane of fifth bits, other widths
one byte a code) and MLX's three arrays are dropped. A 4-, 5- or 8-bit layer whose every
bias is -2^(bits-1) times its scale (GGUF's Q4_0, Q5_0, Q8_0 and Q6_K) gets symmetric tiles, which
hold no biases (the kernel derives them, bit for bit): 8.5 bits a Q8_0 weight, as in the file,
not 9. Every matmul of that layer, a decode
step or a 512-row prefill, runs on the tiles with int8 activations, each tile read once per
call while every row of x passes over it; a row's result is therefore the same whatever
else shares the call.

Other quantized layers keep MLX's layout: matmuls of up to `KERNEL_MAX_ROWS` rows run on
the kernel, larger ones on a float32 copy of the weight when one was made (a BLAS GEMM),
else the kernel as well. The kernel computes every row with the same order of operations
whatever the number of rows. When the kernel rounds 4-bit activations to int8, the float32
copy is fed the same rounded activations (the kernel's `round_int8`), so a prompt gets the
same numbers (up to float32 summation order) on either path.

Float32 models get the same treatment for their `nn.Linear` layers (and a tied LM head):
matmuls of up to `DENSE_MAX_ROWS` rows run on the kernel's float32 path (`dense_matmul`,
each weight row read once for all rows, where a BLAS GEMM packs the whole matrix first),
larger ones on BLAS as before (`use_dense_kernels`). `nn.RoPE` and `nn.RMSNorm` modules run
as one kernel op each (MLX's CPU versions are several ops, which dominate a small decode).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Above this many rows a float32 GEMM beats the kernel (measured on a 2-core AVX-512 box:
# kernel 1.2x at 16 rows, 0.8-0.9x at 64).
KERNEL_MAX_ROWS = 16
# Float32 weights: up to this many rows the kernel's float32 path beats OpenBLAS's GEMM
# (bench/cpu_path.py, 2-core AVX-512 box).
DENSE_MAX_ROWS = 8


# Bytes: one cache line, one AVX-512 load.
_ALIGNMENT = 64


def aligned(a: mx.array) -> mx.array:
    """`a` with its data starting on a 64-byte boundary (a copy, unless it already does).

    MLX's CPU buffers start 8 bytes past one, so without this each 64-byte load the kernel
    makes of a weight spans two cache lines (8-row float32 decode: 1.3x slower). The copy
    is a view into a slightly larger buffer; dtypes NumPy lacks come back unchanged."""
    mx.eval(a)
    address = _address(a)
    if a.size == 0 or address is None or address % _ALIGNMENT == 0:
        return a
    source = np.asarray(a)

    def copy(view: np.ndarray) -> None:
        view[...] = source

    return aligned_array(tuple(a.shape), a.dtype, copy)


def aligned_array(
    shape: tuple[int, ...], dtype: mx.Dtype, fill: Callable[[np.ndarray], None]
) -> mx.array:
    """A new MLX array whose data starts on a 64-byte boundary, written by `fill` through a
    NumPy view of MLX's own memory before any use (so nothing is copied after)."""
    size = int(np.prod(shape, dtype=np.int64))
    pad = _ALIGNMENT // dtype.size
    flat = mx.zeros((size + pad,), dtype)
    mx.eval(flat)
    buffer = np.array(flat, copy=False)
    start = (-buffer.ctypes.data % _ALIGNMENT) // dtype.size
    fill(buffer[start : start + size].reshape(shape))
    out = flat[start : start + size].reshape(shape)  # a view: no copy
    mx.eval(out)
    return out


def _address(a: mx.array) -> int | None:
    """Where `a`'s data starts, or None for a dtype NumPy cannot view (bfloat16)."""
    try:
        return int(np.array(a, copy=False).ctypes.data)
    except (RuntimeError, TypeError, ValueError):
        return None


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


def _tiled_matmul(layer: Any, x: mx.array) -> mx.array:
    """x @ W.T on `layer`'s int8 tiles (float32 x)."""
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    out: mx.array = layer.kernels.packed_matmul(
        x, layer["packed"], layer.out_features, layer.tile_bits, layer.symmetric
    )
    return out


class KernelPackedLinear(nn.QuantizedLinear):
    """A 4/8-bit `nn.QuantizedLinear` whose weight lives only in the int8 kernel's tiles
    (`pack_int8`): every matmul, decode step or prefill, runs on the kernel's int8 path, so a
    row's result never depends on how many rows share the call."""

    kernels: ModuleType
    out_features: int
    in_features: int
    tile_bits: int
    symmetric: bool

    def __call__(self, x: mx.array) -> mx.array:
        y = _tiled_matmul(self, x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.in_features}, output_dims={self.out_features}, "
            f"bias={'bias' in self}, group_size={self.group_size}, bits={self.bits}, int8 tiles"
        )


class KernelPackedEmbedding(nn.QuantizedEmbedding):
    """An `nn.QuantizedEmbedding` held only in the int8 kernel's tiles: `as_linear` (a tied
    LM head) runs on them, and lookups read their rows from them (`tile_rows`), so the
    table is in memory once (Gemma 3's 262k x 640 Q8_0 table: 178 MB in symmetric tiles)."""

    kernels: ModuleType
    out_features: int
    in_features: int
    tile_bits: int
    symmetric: bool

    def __call__(self, x: mx.array) -> mx.array:
        return tile_rows(self["packed"], x, self.tile_bits, self.in_features, self.symmetric)

    def as_linear(self, x: mx.array) -> mx.array:
        return _tiled_matmul(self, x)


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


class KernelRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` on the kernel's one-op rms norm (float32 input), where MLX's CPU
    rms_norm runs several ops."""

    kernels: ModuleType

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if x.dtype != mx.float32 or weight.dtype != mx.float32:
            return super().__call__(x)
        out: mx.array = self.kernels.rms_norm(x, weight, float(self.eps))
        return out


class KernelOffsetRMSNorm(nn.Module):
    """Gemma's RMS norm (mlx-lm's gemma, gemma2 and gemma3_text `RMSNorm`: scale by
    `1 + weight`) on the kernel's one-op rms norm, `1 + weight` computed once at the swap
    and held outside the parameters (where mlx-lm adds it on every call)."""

    kernels: ModuleType
    eps: float

    def __call__(self, x: mx.array) -> mx.array:
        scale: mx.array = vars(self)["offset_weight"]
        if x.dtype != mx.float32 or scale.dtype != mx.float32:
            return mx.fast.rms_norm(x, 1.0 + self["weight"], self.eps)
        out: mx.array = self.kernels.rms_norm(x, scale, float(self.eps))
        return out


# mlx-lm modules whose `RMSNorm` scales by 1 + weight.
_OFFSET_NORM_MODULES = frozenset(
    f"mlx_lm.models.{name}" for name in ("gemma", "gemma2", "gemma3_text")
)


def _swap_exact(model: nn.Module, kernels: ModuleType, kind: type, to: type) -> int:
    """Switch every module of exactly type `kind` (not a subclass) to `to`; how many."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is kind:
            module.__class__ = to
            setattr(module, "kernels", kernels)  # noqa: B010  (narrowed to object by mypy)
            changed += 1
    return changed


def use_norm_kernel(model: nn.Module, kernels: ModuleType) -> int:
    """Switch `model`'s plain `nn.RMSNorm` modules to `KernelRMSNorm`, and Gemma's
    `1 + weight` ones to `KernelOffsetRMSNorm`. Returns how many."""
    changed = _swap_exact(model, kernels, nn.RMSNorm, KernelRMSNorm)
    for _, module in model.named_modules():
        kind = type(module)
        if kind.__name__ != "RMSNorm" or kind.__module__ not in _OFFSET_NORM_MODULES:
            continue
        offset = 1.0 + module["weight"]
        mx.eval(offset)
        vars(module)["offset_weight"] = offset  # not a parameter: derived from `weight`
        module.__class__ = KernelOffsetRMSNorm
        module.kernels = kernels
        changed += 1
    return changed


def use_rope_kernel(model: nn.Module, kernels: ModuleType) -> int:
    """Switch `model`'s plain `nn.RoPE` modules (not the scaled variants) to `KernelRoPE`.
    Returns how many changed."""
    return _swap_exact(model, kernels, nn.RoPE, KernelRoPE)


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
        module["weight"] = aligned(weight)
        changed += 1
    return changed


_TILED_BITS = (2, 3, 4, 5, 6, 8)  # widths the int8 tiles hold (all but 4 as bytes)
_MLX_LAYOUT_BITS = (4, 8)  # widths the kernel reads in MLX's own layout


def supports(module: Any) -> bool:
    """Whether the kernel can run this quantized layer (tiled, or for 4 and 8 bits in
    MLX's layout too)."""
    if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return False
    if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
        return False
    bits, group_size = int(module.bits), int(module.group_size)
    in_features = int(module.weight.shape[-1]) * 32 // bits
    return bits in _TILED_BITS and group_size % 32 == 0 and in_features % group_size == 0


_TILE_ROWS = 16  # weight rows per tile (the kernel's kRowTile)


def tile_bits(bits: int) -> int:
    """The tile width that holds `bits`-bit codes: 4 and 5 as they are (5: 4-bit nibbles
    and a plane of fifth bits), the other widths from 2 to 8 as bytes."""
    return bits if bits in (4, 5) else 8


def codes(weight: mx.array, bits: int) -> np.ndarray:
    """A `bits`-bit MLX weight's codes, one uint8 per value ([N, K]): MLX packs each row as
    one little-endian bit stream (value j in bits j * bits to j * bits + bits - 1)."""
    return _codes_of_rows(np.asarray(weight).view(np.uint8).reshape(int(weight.shape[0]), -1), bits)


def _codes_of_rows(raw: np.ndarray, bits: int) -> np.ndarray:
    """`codes` of rows given as their bytes ([N, bytes a row] uint8)."""
    if bits == 8:
        return raw
    n = raw.shape[0]
    stream = np.unpackbits(raw, axis=1, bitorder="little")
    k = stream.shape[1] // bits
    per_value = stream[:, : k * bits].reshape(n, k, bits)
    return np.packbits(per_value, axis=2, bitorder="little").reshape(n, k)


# Tiles packed at a time: NumPy's temporaries stay a few MB, where packing a whole 262k-row
# embedding at once held several copies of its table besides the result (1.26 GB peak RSS
# loading Gemma 3 270M, bench/gguf_memory.py).
_PACK_TILES = 1024


def symmetric(scales: mx.array, biases: mx.array, bits: int) -> bool:
    """Whether a 4-, 5- or 8-bit layer's every bias is -2^(bits-1) times its scale (GGUF's
    Q4_0, Q5_0, Q8_0 and Q6_K), so that its tiles can leave the biases out."""
    if bits != tile_bits(bits):
        return False
    return bool(mx.array_equal(biases, scales * -float(1 << (bits - 1))))


def pack_int8(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int = 4,
    *,
    symmetric: bool = False,
) -> mx.array:
    """A 2- to 8-bit affine weight ([N, K * bits / 32] uint32, [N, K / group_size] scales
    and biases) in the int8 kernel's tiles: [ceil(N / 16), K / 32, 320, 384 or 576] uint8,
    rows past N zero. Per 32-value block a tile holds its 16 rows' weights in groups of 4
    values (4-bit: one byte per row and value pair k, k + 4, low nibble first; 5-bit: the
    same of the codes' low 4 bits, then their fifth bits, 8 little-endian 64-bit masks, one
    per group for its low nibbles and one for its high ones, bit i for the group's byte i;
    other widths: one byte a value, as 8-bit tiles), each group 16 rows x 4 bytes, then the
    16 block scales and the 16 block biases as float16. With `symmetric` (a 4-, 5- or 8-bit
    weight whose biases are -2^(bits-1) times their scales: see `symmetric`) the biases are
    left out, 32 bytes less a block. Packed `_PACK_TILES` tiles at a time straight into the
    result."""
    n = int(weight.shape[0])
    k = int(weight.shape[1]) * 32 // bits
    blocks = k // 32
    tiles = (n + _TILE_ROWS - 1) // _TILE_ROWS
    raw = np.asarray(weight).view(np.uint8).reshape(n, -1)
    kept = (scales,) if symmetric else (scales, biases)
    per_group = [np.asarray(values.astype(mx.float32)) for values in kept]
    code_bytes = _TILE_ROWS * 32 * tile_bits(bits) // 8
    half_bytes = _TILE_ROWS * 2  # a block's 16 float16 scales (or biases)

    def fill(out: np.ndarray) -> None:
        for first in range(0, tiles, _PACK_TILES):
            last = min(tiles, first + _PACK_TILES)
            rows = slice(first * _TILE_ROWS, last * _TILE_ROWS)
            out[first:last, :, :code_bytes] = _tile_codes(raw[rows], last - first, k, bits)
            for i, values in enumerate(per_group):
                at = code_bytes + i * half_bytes
                per_block = np.repeat(values[rows], group_size // 32, axis=1)
                out[first:last, :, at : at + half_bytes] = _tile_halves(per_block, last - first)

    shape = (tiles, blocks, code_bytes + len(per_group) * half_bytes)
    return aligned_array(shape, mx.uint8, fill)


def _tile_codes(raw: np.ndarray, tiles: int, k: int, bits: int) -> np.ndarray:
    """The code bytes of `tiles` tiles whose rows are `raw` (fewer rows than the tiles hold
    in the last one: the rest zero), [tiles, blocks, code bytes]."""
    blocks = k // 32
    values = np.zeros((tiles * _TILE_ROWS, k), np.uint8)
    if bits == 4:
        values[: len(raw), 0::2] = raw & 0x0F  # MLX packs the lower nibble first
        values[: len(raw), 1::2] = raw >> 4
    else:
        values[: len(raw)] = _codes_of_rows(raw, bits)
    if tile_bits(bits) == 8:
        groups = values.reshape(tiles, _TILE_ROWS, blocks, 8, 4)
        # -> [tile, block, group, row, value in group]
        return groups.transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)
    # [tile, row, block, group, k or k + 4, value in group] -> [tile, block, group, k or
    # k + 4, row, value in group]: a group's byte i is row i / 4, value i % 4
    split = values.reshape(tiles, _TILE_ROWS, blocks, 4, 2, 4).transpose(0, 2, 3, 4, 1, 5)
    low = split & 0x0F
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(tiles, blocks, -1)
    if bits == 4:
        return nibbles
    # the fifth bits: per group, a 64-bit mask for its low nibbles, then its high ones
    fifth = np.packbits((split >> 4).reshape(tiles, blocks, 4, 2, 64), axis=4, bitorder="little")
    return np.concatenate([nibbles, fifth.reshape(tiles, blocks, -1)], axis=2)


def _tile_halves(per_block: np.ndarray, tiles: int) -> np.ndarray:
    """Per-block float32 values of the tiles' rows ([rows, blocks]) as the tiles hold them:
    float16, block by block, 16 rows each, as bytes [tiles, blocks, 32]."""
    blocks = per_block.shape[1]
    padded = np.zeros((tiles * _TILE_ROWS, blocks), np.float16)
    padded[: len(per_block)] = per_block
    by_block = padded.reshape(tiles, _TILE_ROWS, blocks).transpose(0, 2, 1)
    return np.ascontiguousarray(by_block).view(np.uint8)


def tile_rows(
    tiles: mx.array, ids: mx.array, bits: int, k: int, symmetric: bool = False
) -> mx.array:
    """Rows `ids` of the weight `pack_int8` tiled, as float32 (`ids.shape + (k,)`): each
    value `scale * code + bias` with its block's scale and bias (symmetric tiles: bias
    -2^(bits-1) times the scale), as MLX dequantizes."""
    flat = ids.reshape(-1)
    picked = tiles[flat // _TILE_ROWS]  # [n, blocks, bytes]: the tile holding each row
    n, blocks = flat.size, k // 32
    row = (flat % _TILE_ROWS).reshape(n, 1, 1, 1, 1)
    code_bytes = _TILE_ROWS * 32 * bits // 8  # a block's codes, all 16 rows
    groups = 8 if bits == 8 else 4
    nibble_bytes = _TILE_ROWS * 32 * 4 // 8 if bits in (4, 5) else code_bytes  # w/o 5th bits
    codes = picked[..., :nibble_bytes].reshape(n, blocks, groups, _TILE_ROWS, 4)
    mine = mx.take_along_axis(codes, row, axis=3)  # [n, blocks, groups, 1, 4]
    if bits in (4, 5):  # a byte holds values k (low nibble) and k + 4 (high) of its group
        mine = mx.concatenate([mine & 0x0F, mine >> 4], axis=3)  # [n, blocks, 4, 2, 4]
    if bits == 5:  # row r's fifth bits: bits 4 (r % 2) to 4 (r % 2) + 3 of mask byte r / 2
        masks = picked[..., nibble_bytes:code_bytes].reshape(n, blocks, 4, 2, 8)
        byte = mx.take_along_axis(masks, row // 2, axis=4)  # [n, blocks, 4, 2, 1]
        shifts = (row % 2) * 4 + mx.arange(4, dtype=mx.uint8)
        mine = mine + ((byte >> shifts.astype(mx.uint8)) & 1) * 16
    values = mine.reshape(n, blocks, 32).astype(mx.float32)
    kinds = 1 if symmetric else 2  # scales, then biases unless symmetric
    halves = picked[..., code_bytes:].reshape(n, blocks, kinds, _TILE_ROWS, 2)
    per_row = mx.take_along_axis(halves, row, axis=3).reshape(n, blocks, kinds, 2)
    scale_bias = mx.view(per_row, mx.float16).reshape(n, blocks, kinds).astype(mx.float32)
    scale = scale_bias[..., 0:1]
    bias = scale * -float(1 << (bits - 1)) if symmetric else scale_bias[..., 1:2]
    out = values * scale + bias
    return out.reshape(*ids.shape, k)


def _packable(module: Any, kernels: ModuleType) -> bool:
    """A layer the int8 kernel can hold in tiles: the CPU has the int8 path and its scales
    and biases are exact in float16 (GGUF's always are)."""
    if not kernels.int8():
        return False
    for name in ("scales", "biases"):
        values = module[name]
        if not bool(mx.array_equal(values.astype(mx.float16).astype(values.dtype), values)):
            return False
    return True


def _tile(module: Any, kernels: ModuleType) -> None:
    """Give `module` its int8 tiles in place of MLX's arrays (an embedding's lookups read
    the tiles too)."""
    bits = int(module.bits)
    module.symmetric = symmetric(module["scales"], module["biases"], bits)
    module["packed"] = pack_int8(
        module["weight"],
        module["scales"],
        module["biases"],
        int(module.group_size),
        bits,
        symmetric=module.symmetric,
    )
    module.tile_bits = tile_bits(bits)
    module.out_features = int(module["weight"].shape[0])
    module.in_features = int(module["weight"].shape[1]) * 32 // int(module.bits)
    module.kernels = kernels
    for name in ("weight", "scales", "biases"):
        del module[name]
    embedding = isinstance(module, nn.QuantizedEmbedding)
    module.__class__ = KernelPackedEmbedding if embedding else KernelPackedLinear


def use_cpu_kernels(model: nn.Module, kernels: ModuleType, *, dense: bool) -> int:
    """Switch the supported quantized layers of `model` to the kernel; with `dense`, also
    keep a float32 copy of each untiled weight for prefill. Returns how many changed."""
    changed = 0
    for _, module in model.named_modules():
        if not supports(module):
            continue
        if _packable(module, kernels):
            _tile(module, kernels)
            changed += 1
            continue
        if int(module.bits) not in _MLX_LAYOUT_BITS:
            continue  # MLX's own quantized matmul
        changed += 1
        scales = module["scales"]
        if scales.dtype != mx.float32:
            module["scales"] = scales.astype(mx.float32)
            module["biases"] = module["biases"].astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            module.__class__ = KernelQuantizedEmbedding
        else:
            module.__class__ = KernelQuantizedLinear
        module.kernels = kernels
        for name in ("weight", "scales", "biases"):
            module[name] = aligned(module[name])
        if dense:
            module["dense"] = mx.dequantize(
                module["weight"],
                module["scales"],
                module["biases"],
                group_size=module.group_size,
                bits=module.bits,
            ).astype(mx.float32)
    if changed:
        mx.eval(model.parameters())
    return changed
