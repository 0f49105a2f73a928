"""CPU attention on mlxcel's kernel, decode and prefill (cpu_kernels/attention.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine.cpu_kernels.attention import _kernel_mask, use_attention_kernel

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the CPU kernel is built for Linux's CPU backend only"
)


def _mlx_sdpa() -> object:
    current = mx.fast.scaled_dot_product_attention
    return getattr(current, "mlxcel_original", current)


def _qkv(b: int, hq: int, hkv: int, rows: int, keys: int, dim: int) -> tuple[mx.array, ...]:
    """q, and k / v as a KV cache hands them over: a slice of a longer buffer."""
    q = mx.random.normal((b, hq, rows, dim), key=mx.random.key(rows))
    k = mx.random.normal((b, hkv, keys + 9, dim), key=mx.random.key(keys))[:, :, :keys, :]
    v = mx.random.normal((b, hkv, keys + 9, dim), key=mx.random.key(dim))[:, :, :keys, :]
    return q, k, v


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "rows", "keys", "dim", "mask"),
    [
        (1, 9, 3, 1, 80, 64, None),
        (2, 9, 3, 3, 80, 64, "causal"),
        (2, 4, 4, 1, 10, 32, None),
        (1, 8, 2, 5, 33, 40, "causal"),
        (2, 6, 3, 1, 50, 64, "bool"),
        (2, 6, 3, 4, 50, 64, "additive"),
        (1, 2, 1, 16, 16, 8, "causal"),
        (1, 9, 3, 70, 70, 64, "causal"),  # a prefill
        (1, 9, 3, 40, 95, 64, "causal"),  # a prefill after a prompt-cache hit
        (2, 6, 3, 33, 50, 64, "additive"),  # a batched prefill with left padding
        (1, 4, 1, 1, 300, 256, None),  # Gemma 3: head size 256, one key head, decode
        (1, 4, 1, 130, 130, 256, "causal"),  # its prefill: 520 rows on one key head
        (1, 4, 1, 70, 600, 256, "bool"),  # a sliding-window layer's chunk
    ],
)
def test_kernel_matches_mlx_attention(
    kernels: ModuleType,
    b: int,
    hq: int,
    hkv: int,
    rows: int,
    keys: int,
    dim: int,
    mask: str | None,
) -> None:
    q, k, v = _qkv(b, hq, hkv, rows, keys, dim)
    m: mx.array | str | None = mask
    if mask in ("bool", "additive"):
        keep = mx.random.uniform(shape=(b, 1, rows, keys), key=mx.random.key(7)) > 0.3
        keep[..., -1] = True  # every row keeps a key
        m = keep if mask == "bool" else mx.where(keep, 0.0, -1e9)
    kind = _kernel_mask(m, q, k.shape[2])
    assert kind is not None
    got = kernels.attention(q, k, v, 0.125, kind[0], kind[1])
    want = _mlx_sdpa()(q, k, v, scale=0.125, mask=m)  # type: ignore[operator]
    atol = 2e-6 * max(1, dim // 64)  # larger scores with longer heads (float32 summation)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=atol, rtol=1e-5)


@pytest.mark.parametrize(("pad", "dim"), [(5, 32), (16, 64), (23, 64), (3, 128)])
def test_masked_padding_keys_change_nothing(kernels: ModuleType, pad: int, dim: int) -> None:
    """A row whose extra (padding) keys a mask removes equals the row on its own keys, bit
    for bit, wherever the padding puts its keys (scores are summed 16 keys at a time)."""
    own = 37
    q, k, v = _qkv(1, 4, 2, 1, pad + own, dim)
    alone = kernels.attention(q, k[:, :, pad:, :], v[:, :, pad:, :], 0.2, 0, None)
    keep = mx.concatenate(
        [mx.zeros((1, 1, 1, pad), dtype=mx.bool_), mx.ones((1, 1, 1, own), mx.bool_)], -1
    )
    padded = kernels.attention(q, k, v, 0.2, 3, mx.broadcast_to(keep, (1, 4, 1, pad + own)))
    assert np.array_equal(np.array(alone), np.array(padded))
    additive = mx.where(keep, 0.0, float("-inf"))
    added = kernels.attention(q, k, v, 0.2, 2, mx.broadcast_to(additive, (1, 4, 1, pad + own)))
    assert np.array_equal(np.array(alone), np.array(added))


def test_a_strided_mask_reads_the_same(kernels: ModuleType) -> None:
    """A mask whose key axis is not contiguous (every other value of a longer row) gives
    what its contiguous copy gives."""
    q, k, v = _qkv(1, 4, 2, 1, 40, 64)
    mask_t = mx.random.normal((1, 1, 1, 80), key=mx.random.key(5))[..., ::2]
    assert mask_t.shape == (1, 1, 1, 40)
    contiguous = mx.array(np.array(mask_t))
    for kind, m in ((2, mask_t), (3, mask_t > 0)):
        strided = kernels.attention(q, k, v, 0.2, kind, mx.broadcast_to(m, (1, 4, 1, 40)))
        copy = contiguous if kind == 2 else contiguous > 0
        dense = kernels.attention(q, k, v, 0.2, kind, mx.broadcast_to(copy, (1, 4, 1, 40)))
        assert np.array_equal(np.array(strided), np.array(dense))


@pytest.mark.parametrize(
    ("shape", "mask"),
    [
        ((8, 8, 4, 1, 300, 64), None),
        ((8, 8, 4, 1, 300, 64), "bool"),
        ((1, 4, 1, 150, 300, 256), "causal"),  # one key head: its rows split across threads
        ((1, 4, 1, 150, 300, 256), "bool"),
    ],
)
def test_split_across_threads_is_bit_identical(
    kernels: ModuleType, shape: tuple[int, ...], mask: str | None
) -> None:
    """A call large enough to be split across the pool's threads (by batch row, key head
    and block of query rows) gives exactly what one thread gives, and matches MLX."""
    b, _, _, rows, keys, _ = shape
    q, k, v = _qkv(*shape)
    m: mx.array | str | None = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(b, 1, rows, keys), key=mx.random.key(3)) > 0.2
        m[..., -1] = True
    kind = _kernel_mask(m, q, k.shape[2])
    assert kind is not None
    threads = kernels.threads()
    try:
        kernels.set_threads(1)
        one = np.array(kernels.attention(q, k, v, 0.125, kind[0], kind[1]))
        kernels.set_threads(2)
        two = np.array(kernels.attention(q, k, v, 0.125, kind[0], kind[1]))
    finally:
        kernels.set_threads(threads)
    assert np.array_equal(one, two)
    want = _mlx_sdpa()(q, k, v, scale=0.125, mask=m)  # type: ignore[operator]
    atol = 2e-6 * max(1, shape[-1] // 64)  # larger scores with longer heads
    np.testing.assert_allclose(two, np.array(want), atol=atol, rtol=1e-5)


def test_wrapper_routes_float32_cpu_calls_to_the_kernel(kernels: ModuleType) -> None:
    assert use_attention_kernel(kernels)
    assert use_attention_kernel(kernels)  # idempotent: wrapped once
    sdpa = mx.fast.scaled_dot_product_attention
    original = sdpa.mlxcel_original  # type: ignore[attr-defined]
    assert not hasattr(original, "mlxcel_original")
    for rows in (1, 16, 17, 200):  # decode, verify rounds and prefill alike
        q, k, v = _qkv(1, 4, 2, rows, 200, 32)
        via_kernel = kernels.attention(q, k, v, 0.3, 1, None)
        got = sdpa(q, k, v, scale=0.3, mask="causal")
        assert np.array_equal(np.array(got), np.array(via_kernel)), rows
    half = [a.astype(mx.float16) for a in _qkv(1, 4, 2, 1, 8, 32)]
    assert sdpa(*half, scale=0.3).dtype == mx.float16  # other dtypes: MLX's own path
    q, k, _ = _qkv(1, 4, 2, 1, 8, 32)
    v = mx.random.normal((1, 2, 8, 16))  # values narrower than keys (MLA): MLX's own path
    assert np.array_equal(
        np.array(sdpa(q, k, v, scale=0.3)), np.array(original(q, k, v, scale=0.3))
    )


@pytest.mark.parametrize("split", [1, 10, 16, 17, 30])
def test_a_rows_attention_does_not_depend_on_how_the_prompt_was_split(
    kernels: ModuleType, split: int
) -> None:
    """A prompt prefilled at once, or its first `split` tokens first (a prompt-cache hit)
    and the rest after: every row's attention is the same bit for bit (it was not when
    calls of up to 16 rows went to the kernel and longer ones to MLX's function)."""
    use_attention_kernel(kernels)
    sdpa = mx.fast.scaled_dot_product_attention
    q, k, v = _qkv(1, 9, 3, 40, 40, 64)
    whole = np.array(sdpa(q, k, v, scale=0.125, mask="causal"))
    head = sdpa(q[:, :, :split], k[:, :, :split], v[:, :, :split], scale=0.125, mask="causal")
    tail = sdpa(q[:, :, split:], k, v, scale=0.125, mask="causal")
    assert np.array_equal(np.concatenate([np.array(head), np.array(tail)], axis=2), whole)


def test_bad_shapes_are_clear_errors(kernels: ModuleType) -> None:
    q, k, v = _qkv(1, 4, 3, 1, 8, 32)
    with pytest.raises(ValueError, match="shapes"):
        kernels.attention(q, k, v, 1.0, 0, None)  # 4 query heads over 3 key heads
    q, k, v = _qkv(1, 4, 2, 1, 8, 32)
    with pytest.raises(ValueError, match="mask"):
        kernels.attention(q, k, v, 1.0, 2, mx.zeros((1, 4, 1, 7)))


def test_auto_policy_installs_it(
    kernels: ModuleType, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.engine.loading import load_model

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", _mlx_sdpa())
    load_model(str(tiny_gguf), cpu_dtype="keep")
    assert not hasattr(mx.fast.scaled_dot_product_attention, "mlxcel_original")
    load_model(str(tiny_gguf), cpu_dtype="auto")
    assert hasattr(mx.fast.scaled_dot_product_attention, "mlxcel_original")
