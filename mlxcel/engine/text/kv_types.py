"""KV cache types: llama-server's `-ctk/-ctv` names on mlx-lm's cache classes.

`f32`, `f16` and `bf16` store keys and values in that float type: mlx-lm's `KVCache`,
`RotatingKVCache` and their batch classes, subclassed here only to cast what the model
writes (the model still computes in its own dtype). `q8_0` and `q4_0` store them as MLX's
affine quantization, 8 or 4 bits a value in groups of `QUANT_GROUP_SIZE` (32, llama.cpp's
block) with a float16 scale and bias per group: mlx-lm's `QuantizedKVCache` for one
sequence, and `BatchQuantizedKVCache` (written here after mlx-lm's `BatchKVCache`, which
has no quantized variant) for continuous batching. Models then attend through mlx-lm's
quantized attention, which mlxcel's CPU kernel takes over (`cpu_kernels.attention`).

A cache made by `make_cache` stays of its type through everything the engine does with it:
merged into a batch, extracted from one, trimmed, copied by the prompt cache. Layers of
other kinds (recurrent state, chunked caches) keep the model's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    create_causal_mask,
    dynamic_roll,
    make_prompt_cache,
)

KV_TYPE_NAMES = ("f32", "f16", "bf16", "q8_0", "q4_0")
QUANT_GROUP_SIZE = 32
_SCALE_BYTES = 2  # float16 scales and biases of the quantized types


@dataclass(frozen=True)
class KVType:
    """One cache type: its llama-server name, float dtype (for the quantized types that of
    the scales and biases) and bits per stored value."""

    name: str
    dtype: mx.Dtype
    bits: int

    @property
    def quantized(self) -> bool:
        return self.name.startswith("q")

    def row_bytes(self, head_dim: int) -> int:
        """Bytes one key (or value) row of `head_dim` values takes."""
        if not self.quantized:
            return head_dim * self.dtype.size
        groups = math.ceil(head_dim / QUANT_GROUP_SIZE)
        return head_dim * self.bits // 8 + 2 * groups * _SCALE_BYTES


_TYPES = {
    "f32": KVType("f32", mx.float32, 32),
    "f16": KVType("f16", mx.float16, 16),
    "bf16": KVType("bf16", mx.bfloat16, 16),
    "q8_0": KVType("q8_0", mx.float16, 8),
    "q4_0": KVType("q4_0", mx.float16, 4),
}


def kv_type(name: str) -> KVType:
    """The type named `name` (ValueError naming those that exist)."""
    found = _TYPES.get(name.strip().lower())
    if found is None:
        raise ValueError(f"KV cache type {name!r} is not supported ({', '.join(KV_TYPE_NAMES)})")
    return found


def kv_types(type_k: str, type_v: str, model: Any = None) -> KVType:
    """The type of `-ctk` and `-ctv`, which must agree, and which `model` (when given) must
    be able to take (`check_model`); ValueError otherwise."""
    k, v = kv_type(type_k), kv_type(type_v)
    if k != v:
        raise ValueError(
            f"-ctk {k.name} with -ctv {v.name}: mlxcel stores keys and values in one type; "
            "give both the same"
        )
    if model is not None:
        check_model(model, k)
    return k


# ------------------------------------------------------------------ float types


class _CastKV:
    """Casts what the model writes to the class's dtype before mlx-lm stores it."""

    kv_dtype: ClassVar[mx.Dtype]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if keys.dtype != self.kv_dtype:
            keys = keys.astype(self.kv_dtype)
            values = values.astype(self.kv_dtype)
        return super().update_and_fetch(keys, values)  # type: ignore[misc]


def _retyped(cache: Any, cls: type) -> Any:
    """`cache` as an instance of `cls`, a subclass of its class with no state of its own."""
    cache.__class__ = cls
    return cache


def _float_family(kv: KVType) -> dict[type, type]:
    """mlx-lm's single-sequence class -> this type's subclass, for `KVCache` and
    `RotatingKVCache`; their batch classes get a subclass each too, which `merge` makes
    and whose `extract` gives the single class back."""
    singles: dict[type, type] = {}
    batches: dict[type, type] = {}
    tag = kv.name.upper()

    def merge(cls: type, caches: list[Any]) -> Any:
        base = next(b for b in cls.__mro__ if b in batches)
        batch: Any = batches[base]
        return batch.merge(caches)

    def batch_merge(cls: Any, caches: list[Any]) -> Any:
        if issubclass(cls, BatchKVCache) and max(c.size() for c in caches) == 0:
            return cls([0] * len(caches))  # mlx-lm's returns a plain BatchKVCache here
        return super(cls, cls).merge(caches)

    def extract(self: Any, idx: int) -> Any:
        cls: Any = type(self)
        plain = super(cls, self).extract(idx)
        return _retyped(plain, singles[type(plain)])

    for base, batch_base in ((KVCache, BatchKVCache), (RotatingKVCache, BatchRotatingKVCache)):
        attrs = {"kv_dtype": kv.dtype}
        singles[base] = type(
            f"{tag}{base.__name__}", (_CastKV, base), {**attrs, "merge": classmethod(merge)}
        )
        batches[base] = type(
            f"{tag}{batch_base.__name__}",
            (_CastKV, batch_base),
            {**attrs, "merge": classmethod(batch_merge), "extract": extract},
        )
    return singles


_FLOAT_CLASSES = {name: _float_family(kv) for name, kv in _TYPES.items() if not kv.quantized}


# ------------------------------------------------------------------ quantized types

_Packed = tuple[mx.array, mx.array, mx.array]  # codes, scales, biases


def _quantize(x: mx.array, group_size: int, bits: int) -> _Packed:
    codes, scales, biases = mx.quantize(x.astype(mx.float16), group_size=group_size, bits=bits)
    return codes, scales, biases


class TypedQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's `QuantizedKVCache` with float16 scales, merged into `BatchQuantizedKVCache`."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache:
    """`BatchKVCache` (left-padded rows, one write index) over quantized keys and values."""

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int, bits: int) -> None:
        self.keys: _Packed | None = None
        self.values: _Packed | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self.group_size = group_size
        self.bits = bits
        self._idx = 0
        self._right_padding: mx.array | None = None

    def _grow(self, like: _Packed, like_v: _Packed, n: int) -> None:
        shape = like[0].shape[:2]
        steps = (self.step + n - 1) // self.step * self.step

        def zeros(x: mx.array) -> mx.array:
            return mx.zeros((*shape, steps, x.shape[-1]), dtype=x.dtype)

        new_k, new_v = tree_map(zeros, like), tree_map(zeros, like_v)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
            return
        prev = self._idx

        def grow(old: mx.array, new: mx.array) -> mx.array:
            return mx.concatenate([old[..., :prev, :], new], axis=2)

        self.keys = tree_map(grow, self.keys, new_k)
        self.values = tree_map(grow, self.values, new_v)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[_Packed, _Packed]:
        q_keys = _quantize(keys, self.group_size, self.bits)
        q_values = _quantize(values, self.group_size, self.bits)
        n = keys.shape[2]
        prev = self._idx
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            self._grow(q_keys, q_values, n)
        assert self.keys is not None and self.values is not None
        self._idx += n
        self.offset = self.offset + n
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = q_keys[i]
            self.values[i][..., prev : self._idx, :] = q_values[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[_Packed, _Packed]:
        assert self.keys is not None and self.values is not None
        idx = self._idx

        def cut(x: mx.array) -> mx.array:
            return x[..., :idx, :]

        return tree_map(cut, self.keys), tree_map(cut, self.values)

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty cache")
            pad = mx.array(list(left_padding))
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(list(right_padding))

    def finalize(self) -> None:
        if self._right_padding is None or self.keys is None or self.values is None:
            return
        padding = self._right_padding

        def roll(x: mx.array) -> mx.array:
            return dynamic_roll(x, padding[:, None], axis=2)

        self.keys, self.values = tree_map(roll, self.keys), tree_map(roll, self.values)
        self.offset = self.offset - padding
        self.left_padding = self.left_padding + padding
        self._right_padding = None

    @property
    def state(self) -> tuple[Any, ...]:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))

    def filter(self, batch_indices: Sequence[int]) -> None:
        index = mx.array(list(batch_indices))
        if self.keys is not None and self.values is not None:

            def pick(x: mx.array) -> mx.array:
                return x[index]

            self.keys, self.values = tree_map(pick, self.keys), tree_map(pick, self.values)
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        shift = min(_ints(self.left_padding)) if len(batch_indices) else 0
        if shift > 0:
            if self.keys is not None and self.values is not None:

                def drop(x: mx.array) -> mx.array:
                    return x[..., shift:, :]

                self.keys, self.values = tree_map(drop, self.keys), tree_map(drop, self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like_k, like_v = like.keys, like.values

        def padded(c: BatchQuantizedKVCache) -> tuple[_Packed, _Packed, mx.array]:
            rows = int(c.offset.shape[0])
            if c.keys is None or c.values is None:

                def empty(x: mx.array) -> mx.array:
                    return mx.zeros((rows, x.shape[1], 0, x.shape[3]), dtype=x.dtype)

                k, v = tree_map(empty, like_k), tree_map(empty, like_v)
            else:
                k, v = c.keys, c.values
            left = idx - c._idx
            right = size - k[0].shape[2] - left

            def place(x: mx.array) -> mx.array:
                if right < 0:
                    x = x[..., :right, :]
                return mx.pad(x, [(0, 0), (0, 0), (left, max(right, 0)), (0, 0)])

            return tree_map(place, k), tree_map(place, v), c.left_padding + left

        k0, v0, pad0 = padded(self)
        k1, v1, pad1 = padded(other)
        self.keys = tree_map(lambda a, b: mx.concatenate([a, b]), k0, k1)
        self.values = tree_map(lambda a, b: mx.concatenate([a, b]), v0, v1)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([pad0, pad1])
        self._idx = idx

    def extract(self, idx: int) -> TypedQuantizedKVCache:
        cache = TypedQuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if self.keys is None or self.values is None:
            return cache
        padding = _ints(self.left_padding)[idx]
        end = self._idx

        def row(x: mx.array) -> mx.array:
            return mx.contiguous(x[idx : idx + 1, :, padding:end])

        cache.keys, cache.values = tree_map(row, self.keys), tree_map(row, self.values)
        cache.offset = end - padding
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        first = caches[0]
        lengths = [int(c.offset) for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        out = cls(padding, first.group_size, first.bits)
        held = [c for c in caches if c.keys is not None]
        if longest == 0 or not held:
            return cls([0] * len(caches), first.group_size, first.bits)

        def zeros(x: mx.array) -> mx.array:
            return mx.zeros((len(caches), x.shape[1], longest, x.shape[3]), dtype=x.dtype)

        keys, values = tree_map(zeros, held[0].keys), tree_map(zeros, held[0].values)
        for i, (pad, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
            if c.keys is None or n == 0:
                continue
            for j in range(3):
                keys[j][i : i + 1, :, pad : pad + n] = c.keys[j][..., :n, :]
                values[j][i : i + 1, :, pad : pad + n] = c.values[j][..., :n, :]
        out.keys, out.values = keys, values
        out.offset = out.offset + longest
        out._idx = longest
        return out


def _ints(a: mx.array) -> list[int]:
    values: Any = a.tolist()
    return [int(v) for v in values]


# ------------------------------------------------------------------ making caches


def typed_cache(cache: list[Any], kv: KVType | None) -> list[Any]:
    """`cache` (fresh from `make_prompt_cache`, or read by `load_prompt_cache` from a file
    saved in type `kv`) with its KV layers of type `kv`, in place; None keeps mlx-lm's
    classes and the model's dtype."""
    if kv is None:
        return cache
    for i, layer in enumerate(cache):
        if kv.quantized:
            if type(layer) is QuantizedKVCache:
                cache[i] = _retyped(layer, TypedQuantizedKVCache)
            elif type(layer) is KVCache and layer.empty():
                cache[i] = TypedQuantizedKVCache(group_size=QUANT_GROUP_SIZE, bits=kv.bits)
            continue
        cls = _FLOAT_CLASSES[kv.name].get(type(layer))
        if cls is not None:
            cache[i] = _retyped(layer, cls)
    return cache


def plain_cache(cache: list[Any]) -> list[Any]:
    """`cache` as mlx-lm's own classes, the same arrays (what `load_prompt_cache` can name
    when it reads a file `save_prompt_cache` wrote); `typed_cache` turns it back. Another
    library's copy of one of them (mlx-vlm's KV caches: the same fields, under the same
    name, which `load_prompt_cache` would read as mlx-lm's) is written as mlx-lm's too."""
    out: list[Any] = []
    for layer in cache:
        for base in (KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache):
            kind = isinstance(layer, base) or type(layer).__name__ == base.__name__
            if kind and type(layer) is not base:
                plain = base.__new__(base)
                plain.__dict__.update(layer.__dict__)
                layer = plain
                break
        out.append(layer)
    return out


def make_cache(model: Any, kv: KVType | None) -> list[Any]:
    """A fresh KV cache for `model` in type `kv` (None: mlx-lm's, in the model's dtype)."""
    return typed_cache(make_prompt_cache(model), kv)


def check_vision(type_k: str, type_v: str) -> None:
    """Refuse (ValueError) a type other than the default for a vision model: mlx-vlm's
    language models keep their KV cache in the model's dtype."""
    if (type_k, type_v) != ("f16", "f16"):
        raise ValueError(
            "-ctk/-ctv: a vision model (mlx-vlm) keeps its KV cache in the model's dtype; "
            "leave them at f16, the default"
        )


def check_model(model: Any, kv: KVType | None) -> None:
    """Refuse (ValueError) a type `model`'s caches cannot take: the quantized types need
    plain KV layers (no sliding window or recurrent state) whose head size is a multiple
    of the group size."""
    if kv is None or not kv.quantized:
        return
    cache = make_prompt_cache(model)
    if not cache or any(type(layer) is not KVCache for layer in cache):
        raise ValueError(
            f"-ctk {kv.name}: this model's cache has sliding-window or recurrent layers, "
            "which the quantized types do not support (use f16, bf16 or f32)"
        )
    head_dim = _head_dim(model)
    if head_dim % QUANT_GROUP_SIZE:
        raise ValueError(
            f"-ctk {kv.name}: the head size {head_dim} is not a multiple of "
            f"{QUANT_GROUP_SIZE} (use f16, bf16 or f32)"
        )


def _head_dim(model: Any) -> int:
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden = int(getattr(args, "hidden_size", 0) or 0)
    heads = int(getattr(args, "num_attention_heads", 0) or 1)
    return hidden // heads if hidden else QUANT_GROUP_SIZE
