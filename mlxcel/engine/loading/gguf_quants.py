"""GGUF quantized tensors as MLX affine triplets (weight, scales, biases), group size 32.

MLX's affine layout holds groups of 32 codes q with one scale s and bias b per group (value
s*q + b) at 2, 3, 4, 5, 6 or 8 bits; mlx 0.32 offers no group size 16. Each ggml type goes to
the layout nearest its own (`layout`), converted from the file's raw bytes a chunk of rows at
a time, so no float copy of a tensor (let alone of the model) is ever made:

- exact, bit for bit: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32, one scale and offset);
- exact, bit for bit, in MLX's `mxfp4` mode (no biases): MXFP4 (blocks of 32 E2M1 codes
  with one E8M0 scale byte; `to_mxfp4`);
- exact up to one rounding of each group's scale and bias to the stored float dtype: Q4_K
  and Q5_K (32-value sub-blocks, value d*sc*q - dmin*m);
- nearest, 8-bit: Q6_K (16-value sub-blocks, value d*sc*(q-32)), each group of two
  sub-blocks on the grid of the one with the larger |sc| at a quarter of its step: that one
  exact, the other rounded to an eighth of the larger one's step at most; symmetric (each
  bias -128 times its scale), as Q8_0;
- nearest, two bits more than the type's nominal width (Q3_K: 5, Q2_K: 4, IQ4_NL and
  IQ4_XS: 6, ...): gguf-py's dequantization of each chunk re-quantized on its group's
  min..max range, at most half a step off. Q2_K/Q3_K sub-blocks of 16 carry their own
  offsets and IQ4's codebook is not evenly spaced, so no narrower layout holds them.

docs/models.md lists the measured error of each type; tests/test_gguf_quants.py holds it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

GROUP_SIZE = 32
_CHUNK_VALUES = 1 << 20  # values converted at a time: bounds the temporary arrays
_HALF_MAX = 65504.0  # the largest float16
_MLX_BITS = (2, 3, 4, 5, 6, 8)

# ggml type ids (gguf.GGMLQuantizationType)
F32, F16, BF16 = 0, 1, 30
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
MXFP4 = 39
FLOAT_TYPES = frozenset({F32, F16, BF16})

Groups = tuple[np.ndarray, np.ndarray, np.ndarray]  # codes uint8 (rows, groups, 32), scales, biases
Decoder = Callable[[np.ndarray, type[np.floating]], Groups]
RowReader = Callable[[int, int], np.ndarray]  # (start, stop) -> raw bytes, a row each


@dataclass(frozen=True)
class Layout:
    """The MLX quantized layout a ggml type loads into: bits per code (group size 32), and
    whether it holds the file's values `exact`ly, `rounded` (each group's scale and bias
    rounded once to the stored dtype) or only the `nearest` ones, in MLX's quantization
    `mode`."""

    bits: int
    fidelity: str  # "exact" | "rounded" | "nearest"
    mode: str = "affine"  # "affine" | "mxfp4"


def layout(ggml_type: int, type_name: str) -> Layout:
    """The layout of quantized type `ggml_type` (named `type_name`, e.g. "IQ4_XS")."""
    if ggml_type == MXFP4:
        return Layout(4, "exact", "mxfp4")
    exact = {Q8_0: 8, Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5}
    if ggml_type in exact:
        return Layout(exact[ggml_type], "exact")
    if ggml_type in (Q4_K, Q5_K):
        return Layout(4 if ggml_type == Q4_K else 5, "rounded")
    digits = re.search(r"\d", type_name)
    nominal = 2 if type_name.startswith("TQ") else int(digits.group()) if digits else 6
    return Layout(next((b for b in _MLX_BITS if b >= nominal + 2), 8), "nearest")


def to_affine(
    read_rows: RowReader, ggml_type: int, type_name: str, shape: tuple[int, ...], dtype: type
) -> dict[str, np.ndarray] | None:
    """The tensor of `shape` whose raw bytes `read_rows(start, stop)` gives (uint8, a row
    each) as MLX (weight, scales, biases), scales and biases in `dtype` (float16 or float32);
    None when a scale or bias does not fit float16. Rows are read and converted
    `_CHUNK_VALUES` values at a time."""
    bits = layout(ggml_type, type_name).bits
    decode = _DECODERS.get(ggml_type) or _nearest(ggml_type, bits)
    width = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    weight = np.empty((rows, width * bits // 32), np.uint32)
    scales: np.ndarray = np.empty((rows, width // GROUP_SIZE), dtype)
    biases = np.empty_like(scales)
    step = max(1, _CHUNK_VALUES // width)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        codes, scale, bias = decode(read_rows(start, end), dtype)
        if dtype == np.float16 and max(np.abs(scale).max(), np.abs(bias).max()) > _HALF_MAX:
            return None
        weight[start:end] = _pack_bits(codes.reshape(end - start, -1), bits)
        scales[start:end] = scale.reshape(end - start, -1)
        biases[start:end] = bias.reshape(end - start, -1)
    lead = shape[:-1]
    return {
        "weight": weight.reshape(*lead, -1),
        "scales": scales.reshape(*lead, -1),
        "biases": biases.reshape(*lead, -1),
    }


def to_mxfp4(read_rows: RowReader, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The MXFP4 tensor of `shape` whose raw bytes `read_rows(start, stop)` gives as MLX's
    `mxfp4` pair (weight, scales), bit for bit.

    A ggml block is one E8M0 byte e and 16 bytes of E2M1 nibbles, value j in the low nibble
    of byte j and value j+16 in the high one; gguf-py reads it as 2^(e-128) times the doubled
    E2M1 value, i.e. 2^(e-127) times the E2M1 value: MLX's `mxfp4` group of 32 with scale
    byte e and the same 4-bit codes (sign in the top bit), packed two a byte in value
    order. So the scale bytes are kept and only the nibbles reordered."""
    width = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    weight = np.empty((rows, width // 8), np.uint32)
    scales = np.empty((rows, width // GROUP_SIZE), np.uint8)
    step = max(1, _CHUNK_VALUES // width)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        blocks = _blocks(read_rows(start, end), 17)
        nibbles = blocks[..., 1:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        weight[start:end] = _pack_bits(codes.reshape(end - start, -1), 4)
        scales[start:end] = blocks[..., 0]
    lead = shape[:-1]
    return {"weight": weight.reshape(*lead, -1), "scales": scales.reshape(*lead, -1)}


# --- the exact and rounded layouts --------------------------------------------------------


def _half(column: np.ndarray) -> np.ndarray:
    """A float16 field of each block (its two bytes, last axis) as float32."""
    return np.ascontiguousarray(column).view(np.float16)[..., 0].astype(np.float32)


def _blocks(chunk: np.ndarray, block_bytes: int) -> np.ndarray:
    return chunk.reshape(len(chunk), -1, block_bytes)


def _q8_0(chunk: np.ndarray, dtype: type) -> Groups:
    """A block: f16 d, 32 int8 codes c, value d*c = d*(c+128) - 128*d."""
    blocks = _blocks(chunk, 34)
    d = _half(blocks[..., 0:2])
    return blocks[..., 2:] ^ np.uint8(0x80), d, d * -128


def _q4_0_q4_1(chunk: np.ndarray, dtype: type, *, offset: bool) -> Groups:
    """A block: f16 d (Q4_1 also an f16 offset m), 16 bytes of nibbles, values 0-15 in the
    low ones and 16-31 in the high ones; value d*(q-8) for Q4_0, d*q + m for Q4_1."""
    blocks = _blocks(chunk, 20 if offset else 18)
    d = _half(blocks[..., 0:2])
    nibbles = blocks[..., -16:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    return codes, d, _half(blocks[..., 2:4]) if offset else d * -8


def _q5_0_q5_1(chunk: np.ndarray, dtype: type, *, offset: bool) -> Groups:
    """A block: f16 d (Q5_1 also an f16 offset m), 32 high bits (a little-endian uint32, bit
    i for value i), 16 bytes of low nibbles (values 0-15 low, 16-31 high): code q = nibble |
    high << 4, value d*(q-16) for Q5_0 and d*q + m for Q5_1."""
    header = 4 if offset else 2
    blocks = _blocks(chunk, 24 if offset else 22)
    d = _half(blocks[..., 0:2])
    high = np.ascontiguousarray(blocks[..., header : header + 4]).view(np.uint32)
    nibbles = blocks[..., header + 4 :]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    shifts = np.arange(GROUP_SIZE, dtype=np.uint32)
    codes = low | (((high >> shifts) & 1).astype(np.uint8) << 4)
    return codes, d, _half(blocks[..., 2:4]) if offset else d * -16


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales sc and offsets m of eight sub-blocks."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q4_k_q5_k(chunk: np.ndarray, dtype: type, *, high_bits: bool) -> Groups:
    """A super-block of 256 values: f16 d and dmin, 12 bytes of 6-bit sc and m for its eight
    32-value sub-blocks, Q5_K then 32 bytes of high bits (bit i of byte l: sub-block i's
    value l), and 128 bytes of nibbles (each 32-byte chunk holds two sub-blocks: the first
    in the low nibbles, the second in the high ones). Value d*sc*q - dmin*m: each sub-block
    is a group with scale d*sc and bias -dmin*m (exact in float32)."""
    blocks = _blocks(chunk, 176 if high_bits else 144)
    rows, supers = blocks.shape[:2]
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    nibbles = blocks[..., -128:].reshape(rows, supers, 4, 1, 32)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-2)  # (.., 4 chunks, 2, 32)
    if high_bits:
        high = blocks[..., 16:48].reshape(rows, supers, 1, 1, 32)
        shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
        codes |= ((high >> shifts) & 1) << 4
    return codes.reshape(rows, -1, GROUP_SIZE), d[..., None] * sc, -dmin[..., None] * m


# --- the nearest layouts ------------------------------------------------------------------


def _q6_k(chunk: np.ndarray, dtype: type) -> Groups:
    """Q6_K super-blocks → 8-bit groups of 32 holding two 16-value sub-blocks.

    A super-block of 256 values is 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
    16 int8 scales sc and an f16 d; value d*sc*(q-32) with q 0..63. Each group is laid on
    the grid of its sub-block with the larger |sc| at a quarter of its step (d*sc/4, the
    sign of that sc kept), which holds that sub-block exactly in 8 bits: -128..124 quarter
    steps; the other one's values are rounded to it (at most an eighth of the larger one's
    step off, within -127..127), or both share a step where their scales are opposite
    (sc, -sc). Codes are those units + 128 and each bias -128 times its scale, as Q8_0's:
    the CPU kernel holds such a layer in its symmetric tiles (8.5 bits a weight, not 9).
    """
    blocks = _blocks(chunk, 210)
    rows, supers = blocks.shape[:2]
    low = blocks[..., :128].reshape(rows, supers, 2, 2, 32)  # (.., half, byte run, 32)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    nibbles = np.concatenate([low & 0x0F, low >> 4], axis=-2)  # (.., half, 4, 32)
    shifts = np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)
    q = (nibbles | (((high >> shifts) & 3) << 4)).astype(np.int32) - 32
    q = q.reshape(rows, supers, 8, 2, 16)  # group, sub-block, value
    sc = blocks[..., 192:208].view(np.int8).astype(np.int32).reshape(rows, supers, 8, 2)
    d = _half(blocks[..., 208:210])
    # the larger |sc| of each group, its sign kept (the first of two equal ones)
    larger = np.take_along_axis(sc, np.abs(sc).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    # opposite scales (sc, -sc) span 257 quarter steps: their common step holds both
    parts = np.where(sc[..., 0] == -sc[..., 1], 1, 4)
    units = np.divide(
        (parts[..., None] * sc)[..., None] * q,
        larger[..., None, None],
        out=np.zeros(q.shape, np.float64),
        where=larger[..., None, None] != 0,
    )
    units = np.rint(units).reshape(rows, supers, 8, GROUP_SIZE)
    codes = (units + 128).astype(np.uint8)  # 0..255: see above
    # as `dtype` stores it, so that the stored bias is -128 times the stored scale exactly
    # (float16 scales below its normal range round differently from 128 times them)
    with np.errstate(over="ignore"):  # out of float16's range: to_affine refuses it
        stored: np.ndarray = (d[..., None] * larger.astype(np.float32) / parts).astype(dtype)
    scale = stored.astype(np.float32)
    return codes.reshape(rows, -1, GROUP_SIZE), scale, scale * -128


def _nearest(ggml_type: int, bits: int) -> Decoder:
    """A decoder re-quantizing gguf-py's dequantization of `ggml_type` at `bits`: each group
    on its min..max range, codes taken against the scale and bias as `dtype` stores them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    top = (1 << bits) - 1
    qtype = GGMLQuantizationType(ggml_type)

    def decode(chunk: np.ndarray, dtype: type) -> Groups:
        try:
            values = np.asarray(dequantize(chunk, qtype), dtype=np.float32)
        except NotImplementedError as exc:
            raise ValueError(f"cannot read ggml type {qtype.name}") from exc
        groups = values.reshape(len(chunk), -1, GROUP_SIZE)
        lo, hi = groups.min(axis=-1), groups.max(axis=-1)
        scale = ((hi - lo) / top).astype(dtype).astype(np.float32)
        bias = lo.astype(dtype).astype(np.float32)
        steps = np.divide(
            groups - bias[..., None],
            scale[..., None],
            out=np.zeros_like(groups),
            where=scale[..., None] > 0,
        )
        codes = np.clip(np.rint(steps), 0, top).astype(np.uint8)
        return codes, scale, bias

    return decode


_DECODERS: dict[int, Decoder] = {
    Q8_0: _q8_0,
    Q4_0: partial(_q4_0_q4_1, offset=False),
    Q4_1: partial(_q4_0_q4_1, offset=True),
    Q5_0: partial(_q5_0_q5_1, offset=False),
    Q5_1: partial(_q5_0_q5_1, offset=True),
    Q4_K: partial(_q4_k_q5_k, high_bits=False),
    Q5_K: partial(_q4_k_q5_k, high_bits=True),
    Q6_K: _q6_k,
}


def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (uint8 rows, a multiple of 32 each) packed as MLX packs them: a little-endian
    bit stream, value i at bits [i*bits, (i+1)*bits), read as uint32 words per row."""
    rows = codes.shape[0]
    if bits == 8:
        return np.ascontiguousarray(codes).view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.uint32)
    octets = codes.reshape(rows, -1, 8).astype(np.uint64)
    words = (octets << (np.arange(8, dtype=np.uint64) * np.uint64(bits))).sum(
        axis=-1, dtype=np.uint64
    )
    stream = words.view(np.uint8).reshape(rows, -1, 8)[..., :bits]
    return np.ascontiguousarray(stream).reshape(rows, -1).view(np.uint32)
