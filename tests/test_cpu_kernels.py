"""mlxcel's CPU kernel: quantized matmuls on packed weights (an MLX extension built here)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.config import process_env
from mlxcel.engine.cpu_kernels import build
from mlxcel.engine.cpu_kernels.layers import (
    KERNEL_MAX_ROWS,
    KernelPackedLinear,
    KernelQuantizedEmbedding,
    KernelQuantizedLinear,
    aligned,
    pack_int8,
    tile_rows,
)

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the CPU kernel is built for Linux's CPU backend only"
)


def _weights(n: int, k: int, bits: int, group: int, seed: int = 0) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    dense = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
    return packed, scales, biases, dense


@pytest.fixture
def float_activations(kernels: ModuleType) -> Iterator[ModuleType]:
    """The kernel with its int8 activations path off (restored afterwards)."""
    kernels.set_int8(False)
    yield kernels
    kernels.set_int8(process_env.kernel_int8_enabled())


def _rounded_x(x: np.ndarray) -> np.ndarray:
    """x as the int8 path sees it: each 32-value block rounded to int8 steps of max|x|/127
    (float32 arithmetic, round half to even, as the kernel does)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    q = np.rint(blocks * inv)
    return (q * (amax / np.float32(127.0))).reshape(x.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_kernel_matches_dequantized_matmul(
    float_activations: ModuleType, bits: int, group: int, rows: int
) -> None:
    kernels = float_activations
    packed, scales, biases, dense = _weights(70, 256, bits, group, seed=rows)
    x = mx.array(np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float32))
    got = kernels.quantized_matmul(x, packed, scales, biases, group, bits)
    assert got.shape == (rows, 70) and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(x @ dense.T), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("group", "rows", "k"),
    [(32, 1, 576), (64, 2, 448), (32, 5, 1536), (64, 17, 256), (128, 1, 640), (128, 4, 384)],
)
def test_int8_path_is_the_exact_product_of_rounded_x(
    kernels: ModuleType, group: int, rows: int, k: int
) -> None:
    """With integer dot products (AVX-512 VNNI) 4-bit matmuls round x to int8 per 32 values
    (as llama.cpp does): the result is x-rounded @ w to float32 accuracy, and within 1% (rms)
    of the float32 product. K = 448 and 576 end in a partial 128-value step."""
    if not kernels.int8_simd:
        pytest.skip("this CPU has no AVX-512 VNNI: 4-bit matmuls keep float32 activations")
    kernels.set_int8(True)
    packed, scales, biases, dense = _weights(130, k, 4, group, seed=k + rows)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    got = np.array(kernels.quantized_matmul(mx.array(x), packed, scales, biases, group, 4))
    w = np.array(dense, dtype=np.float64)
    exact = _rounded_x(x).astype(np.float64) @ w.T
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    full = x.astype(np.float64) @ w.T
    rms = np.sqrt(((got - full) ** 2).mean() / (full**2).mean())
    assert 1e-4 < rms < 1e-2  # rounded (not the float path), and close
    kernels.set_int8(process_env.kernel_int8_enabled())


def test_rows_are_computed_independently_bit_for_bit(kernels: ModuleType) -> None:
    """A sequence's logits do not depend on what else is in the batch."""
    packed, scales, biases, _ = _weights(96, 192, 4, 64)
    x = mx.array(np.random.default_rng(1).standard_normal((7, 192)).astype(np.float32))
    batch = np.array(kernels.quantized_matmul(x, packed, scales, biases, 64, 4))
    for i in range(7):
        alone = np.array(kernels.quantized_matmul(x[i : i + 1], packed, scales, biases, 64, 4))
        assert np.array_equal(alone[0], batch[i])


def test_strided_inputs_and_leading_dims(kernels: ModuleType) -> None:
    packed, scales, biases, dense = _weights(40, 128, 8, 32)
    wide = mx.array(np.random.default_rng(2).standard_normal((2, 3, 256)).astype(np.float32))
    x = wide[..., ::2]  # not row-contiguous: gathered by the kernel
    got = kernels.quantized_matmul(x, packed, scales, biases, 32, 8)
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(np.array(got), np.array(x @ dense.T), rtol=1e-4, atol=1e-4)
    transposed = mx.array(np.random.default_rng(3).standard_normal((128, 5)).astype(np.float32)).T
    got = kernels.quantized_matmul(transposed, packed, scales, biases, 32, 8)
    np.testing.assert_allclose(np.array(got), np.array(transposed @ dense.T), rtol=1e-4, atol=1e-4)


def test_bad_arguments_raise_clear_errors(kernels: ModuleType) -> None:
    packed, scales, biases, _ = _weights(8, 64, 4, 32)
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="bits"):
        kernels.quantized_matmul(x, packed, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        kernels.quantized_matmul(x, packed, scales, biases, 48, 4)
    with pytest.raises(ValueError, match="shapes"):
        kernels.quantized_matmul(mx.zeros((1, 32)), packed, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="float32"):
        kernels.quantized_matmul(x.astype(mx.float16), packed, scales, biases, 32, 4)


def _count(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for _, m in model.named_modules())


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_auto_policy_runs_quantized_layers_on_the_kernel(
    kernels: ModuleType, tiny_llama_dir: Path, tmp_path: Path, quant: str
) -> None:
    from fixtures.tiny_models import write_tiny_gguf

    from mlxcel.engine.loading import load_model

    gguf = write_tiny_gguf(tiny_llama_dir, tmp_path / f"tiny.{quant}.gguf", quant)
    auto = load_model(str(gguf), cpu_dtype="auto")
    widened = load_model(str(gguf), cpu_dtype="float32")
    tiled = _count(auto.model, KernelPackedLinear)
    if kernels.int8():
        # GGUF's float16 scales fit the int8 tiles exactly: every 4/8-bit layer is tiled
        assert tiled > 0 and _count(auto.model, KernelQuantizedLinear) == 0
        assert "int8 tiles" in auto.info.quantization
    else:
        assert tiled == 0 and _count(auto.model, KernelQuantizedLinear) > 0
    assert "mlxcel CPU kernel" in auto.info.quantization
    assert auto.info.num_parameters == widened.info.num_parameters
    tokens = auto.tokenizer.encode("hello world, the quick brown fox")
    # one row (decode) and many rows (prefill: the tiles, or the float32 copy) both agree
    for ids in (tokens[:1], (tokens * 4)[: KERNEL_MAX_ROWS + 5]):
        a = np.array(auto.model(mx.array([ids])))
        b = np.array(widened.model(mx.array([ids])))
        if kernels.int8():
            # x rounded to 8 bits at every layer by the tiles' int8 path
            rms = np.sqrt(((a - b) ** 2).mean() / (b**2).mean())
            assert rms < 2e-2
        else:
            np.testing.assert_allclose(a, b, atol=2e-3, rtol=2e-3)


def _not_half_exact_layer(kernels: ModuleType, k: int = 96, n: int = 40) -> nn.Module:
    """A 4-bit layer whose float32 scales are not exact in float16: it keeps MLX's layout
    (the tiles store float16) and, with `dense`, a float32 copy for prefill."""
    from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

    model = nn.Sequential(nn.Linear(k, n, bias=False))
    model.layers[0].weight = mx.random.normal((n, k), key=mx.random.key(1))
    nn.quantize(model, group_size=32, bits=4)
    layer = model.layers[0]
    layer.scales = layer.scales.astype(mx.float32) * (1 + 2**-20)
    layer.biases = layer.biases.astype(mx.float32)
    assert use_cpu_kernels(model, kernels, dense=True) == 1
    return model.layers[0]


def test_prefill_copy_rounds_like_the_int8_kernel(kernels: ModuleType) -> None:
    """More than KERNEL_MAX_ROWS rows of an untiled layer go to the float32 copy; with the
    int8 path on they are rounded first, so they agree with the kernel's integer products up
    to float32 summation (a prompt's numbers are the same prefilled alone or in a batch)."""
    from mlxcel.engine.cpu_kernels.layers import _kernel_matmul

    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: the kernel keeps float32 activations")
    layer = _not_half_exact_layer(kernels)
    assert isinstance(layer, KernelQuantizedLinear) and layer.get("dense") is not None
    k = layer.weight.shape[-1] * 32 // layer.bits
    x = mx.random.normal((1, KERNEL_MAX_ROWS + 7, k), key=mx.random.key(3))
    via_copy = np.array(_kernel_matmul(kernels, x, layer, layer["dense"]))
    via_kernel = np.array(
        kernels.quantized_matmul(
            x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits
        )
    )
    np.testing.assert_allclose(via_copy, via_kernel, atol=1e-4, rtol=1e-4)
    unrounded = np.array(x @ layer["dense"].T)
    assert np.abs(unrounded - via_kernel).max() > 10 * np.abs(via_copy - via_kernel).max()


@pytest.mark.parametrize(
    ("n", "k", "group"),
    [(1536, 576, 32), (577, 576, 32), (130, 160, 32), (576, 1536, 64), (7, 96, 32), (9, 512, 128)],
)
def test_int8_tiles_give_the_rounded_x_product(
    kernels: ModuleType, n: int, k: int, group: int
) -> None:
    """4-bit tiles (N not a multiple of the 16-row tile, groups of 32 to 128), for 1 to 70
    rows: the product of the int8-rounded x with the dequantized weight, up to float32
    summation, as the int8 kernel on MLX's layout gives it; each row equals that row
    computed alone."""
    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    packed, scales, biases, _ = _weights(n, k, 4, group, seed=n)
    scales = scales.astype(mx.float16).astype(mx.float32)
    biases = biases.astype(mx.float16).astype(mx.float32)
    dense = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=4))
    tiles = pack_int8(packed, scales, biases, group)
    assert tiles.shape == ((n + 15) // 16, k // 32, 320)
    for m in (1, 3, 4, 17, 70):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        got = np.array(kernels.packed_matmul(x, tiles, n))
        want = _rounded_x(np.array(x)) @ dense.T
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=1e-4)
        on_mlx_layout = np.array(kernels.quantized_matmul(x, packed, scales, biases, group, 4))
        np.testing.assert_allclose(got, on_mlx_layout, atol=1e-5 * np.abs(want).max())
        alone = np.array(kernels.packed_matmul(x[-1:], tiles, n))
        assert np.array_equal(alone[0], got[-1])


@pytest.mark.parametrize(("n", "k", "group"), [(1536, 576, 32), (130, 160, 32), (9, 512, 64)])
def test_8bit_tiles_give_the_rounded_x_product(
    kernels: ModuleType, n: int, k: int, group: int
) -> None:
    """8-bit tiles (a Q8_0 LM head): exactly the product of the int8-rounded x with the
    dequantized weight, up to float32 summation; each row equals that row alone."""
    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    packed, scales, biases, _ = _weights(n, k, 8, group, seed=n)
    scales = scales.astype(mx.float16).astype(mx.float32)
    biases = biases.astype(mx.float16).astype(mx.float32)
    dense = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=8))
    tiles = pack_int8(packed, scales, biases, group, bits=8)
    assert tiles.shape == ((n + 15) // 16, k // 32, 576)
    for m in (1, 5, 33):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        got = np.array(kernels.packed_matmul(x, tiles, n, 8))
        want = _rounded_x(np.array(x)) @ dense.T
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=1e-4)
        alone = np.array(kernels.packed_matmul(x[:1], tiles, n, 8))
        assert np.array_equal(alone[0], got[0])


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_widths_ride_the_8bit_or_5bit_tiles(kernels: ModuleType, bits: int) -> None:
    """2/3/6-bit codes are unpacked from MLX's bit stream into the 8-bit tiles, 5-bit ones
    (GGUF's Q5_0/Q5_1 load as 5-bit groups of 32) into the 5-bit tiles: exactly MLX's
    dequantized rows, and the product of the int8-rounded x with the dequantized weight;
    the layer swap tiles such a layer and keeps its bit width."""
    from mlxcel.engine.cpu_kernels.layers import codes, tile_bits, use_cpu_kernels

    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    n, k, group = 70, 160, 32
    packed, scales, biases, _ = _weights(n, k, bits, group, seed=bits)
    scales = scales.astype(mx.float16).astype(mx.float32)
    biases = biases.astype(mx.float16).astype(mx.float32)
    dense = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits))
    values = codes(packed, bits)
    assert values.shape == (n, k) and int(values.max()) < 2**bits
    per_value = np.repeat(np.array(scales), group, 1), np.repeat(np.array(biases), group, 1)
    assert np.array_equal(values * per_value[0] + per_value[1], dense)
    width = tile_bits(bits)
    assert width == (5 if bits == 5 else 8)
    tiles = pack_int8(packed, scales, biases, group, bits=bits)
    assert tiles.shape == ((n + 15) // 16, k // 32, 16 * 32 * width // 8 + 64)
    ids = mx.array([0, 15, 16, 69])
    assert np.array_equal(np.array(tile_rows(tiles, ids, width, k)), dense[np.array(ids)])
    x = mx.random.normal((5, k), key=mx.random.key(bits))
    got = np.array(kernels.packed_matmul(x, tiles, n, width))
    want = _rounded_x(np.array(x)) @ dense.T
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=1e-4)
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    nn.quantize(model, group_size=group, bits=bits)
    layer = model.layers[0]
    layer.weight, layer.scales, layer.biases = packed, scales, biases
    assert use_cpu_kernels(model, kernels, dense=False) == 1
    tiled = model.layers[0]
    assert isinstance(tiled, KernelPackedLinear) and (tiled.bits, tiled.tile_bits) == (bits, width)
    np.testing.assert_allclose(np.array(tiled(x)), got, atol=1e-6 * np.abs(want).max())


def test_5bit_tiles_give_the_8bit_tiles_products_bit_for_bit(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 5-bit tiles (4-bit nibbles and a plane of fifth bits: 384 bytes a block where the
    8-bit tiles take 576) hold the same codes: every product, for 1 to 17 rows of x, equals
    the one on 8-bit tiles of the same weight bit for bit."""
    from mlxcel.engine.cpu_kernels import layers

    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    for n, k, group in ((70, 160, 32), (33, 512, 64), (1024, 640, 32)):
        packed, scales, biases, _ = _weights(n, k, 5, group, seed=n)
        scales = scales.astype(mx.float16).astype(mx.float32)
        biases = biases.astype(mx.float16).astype(mx.float32)
        five = pack_int8(packed, scales, biases, group, bits=5)
        with monkeypatch.context() as patch:
            patch.setattr(layers, "tile_bits", lambda bits: 8)
            eight = pack_int8(packed, scales, biases, group, bits=5)
        assert (five.shape[2], eight.shape[2]) == (384, 576)
        for m in (1, 2, 3, 5, 8, 17):
            x = mx.random.normal((m, k), key=mx.random.key(m))
            got = np.array(kernels.packed_matmul(x, five, n, 5))
            assert np.array_equal(got, np.array(kernels.packed_matmul(x, eight, n, 8))), (n, m)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_symmetric_tiles_drop_the_biases_and_give_the_same_numbers(
    kernels: ModuleType, bits: int
) -> None:
    """A weight whose biases are -2^(bits-1) times its scales (GGUF's Q4_0, Q5_0, Q8_0) is
    tiled without them, 32 bytes a block less: every product (1 to 17 rows of x) and every
    row read back equals the full tiles' bit for bit; the layer swap picks that layout for
    such a layer only, and the tiled layer gives the full tiles' product."""
    from mlxcel.engine.cpu_kernels.layers import symmetric, use_cpu_kernels

    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    n, k, group = 70, 160, 32
    packed, scales, asymmetric, _ = _weights(n, k, bits, group, seed=bits)
    scales = scales.astype(mx.float16).astype(mx.float32)
    biases = scales * -float(1 << (bits - 1))
    assert symmetric(scales, biases, bits)
    assert not symmetric(scales, asymmetric.astype(mx.float16).astype(mx.float32), bits)
    full = pack_int8(packed, scales, biases, group, bits=bits)
    compact = pack_int8(packed, scales, biases, group, bits=bits, symmetric=True)
    assert compact.shape == (full.shape[0], full.shape[1], full.shape[2] - 32)
    ids = mx.array([0, 15, 16, 69, 3])
    rows = tile_rows(compact, ids, bits, k, symmetric=True)
    assert mx.array_equal(rows, tile_rows(full, ids, bits, k))
    for m in (1, 3, 9, 17):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        got = np.array(kernels.packed_matmul(x, compact, n, bits, True))
        assert np.array_equal(got, np.array(kernels.packed_matmul(x, full, n, bits))), m
    with pytest.raises(ValueError, match="packed weight"):
        kernels.packed_matmul(mx.zeros((1, k)), compact, n, bits)  # read as full tiles
    for layer_biases, expected in ((biases, True), (asymmetric.astype(mx.float32), False)):
        model = nn.Sequential(nn.Linear(k, n, bias=False))
        nn.quantize(model, group_size=group, bits=bits)
        model.layers[0].weight, model.layers[0].scales = packed, scales
        model.layers[0].biases = layer_biases.astype(mx.float16).astype(mx.float32)
        assert use_cpu_kernels(model, kernels, dense=False) == 1
        tiled = model.layers[0]
        assert isinstance(tiled, KernelPackedLinear) and tiled.symmetric is expected
        assert tiled["packed"].shape[2] == full.shape[2] - (32 if expected else 0)
    x = mx.random.normal((3, k), key=mx.random.key(0))
    want = np.array(kernels.packed_matmul(x, full, n, bits))
    model = nn.Sequential(nn.Linear(k, n, bias=False))
    nn.quantize(model, group_size=group, bits=bits)
    model.layers[0].weight, model.layers[0].scales, model.layers[0].biases = packed, scales, biases
    use_cpu_kernels(model, kernels, dense=False)
    assert np.array_equal(np.array(model.layers[0](x)), want)


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_tiles_packed_a_few_at_a_time_are_the_tiles_packed_at_once(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packing 1 or 3 tiles at a time (the loader packs 1024, so a 262k-row embedding never
    has several whole copies in NumPy) gives the same bytes as packing all 5 at once (70
    rows: the last tile partly padding), 64-byte aligned, holding exactly MLX's rows."""
    from mlxcel.engine.cpu_kernels import layers

    packed, scales, biases, dense = _weights(70, 160, bits, 32, seed=bits)
    scales = scales.astype(mx.float16).astype(mx.float32)
    biases = biases.astype(mx.float16).astype(mx.float32)
    dense = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    whole = np.array(pack_int8(packed, scales, biases, 32, bits=bits))
    ids = mx.array([0, 15, 16, 47, 69])
    for at_a_time in (1, 3):
        monkeypatch.setattr(layers, "_PACK_TILES", at_a_time)
        tiles = pack_int8(packed, scales, biases, 32, bits=bits)
        assert np.array(tiles).tobytes() == whole.tobytes() and tiles.shape == whole.shape
        assert np.array(tiles, copy=False).ctypes.data % 64 == 0
        rows = tile_rows(tiles, ids, layers.tile_bits(bits), 160)
        assert np.array_equal(np.array(rows), np.array(dense)[np.array(ids)])


def test_other_widths_without_tiles_stay_on_mlx(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the int8 path a 5-bit layer is left to MLX (the kernel reads MLX's layout
    in 4 and 8 bits only)."""
    from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

    monkeypatch.setattr(kernels, "int8", lambda: False)
    model = nn.Sequential(nn.Linear(64, 16))
    nn.quantize(model, group_size=32, bits=5)
    assert use_cpu_kernels(model, kernels, dense=False) == 0
    assert type(model.layers[0]) is nn.QuantizedLinear


def test_int8_tiles_reject_a_mismatched_weight(kernels: ModuleType) -> None:
    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    packed, scales, biases, _ = _weights(8, 64, 4, 32)
    tiles = pack_int8(packed, scales.astype(mx.float32), biases.astype(mx.float32), 32)
    with pytest.raises(ValueError, match="packed weight"):
        kernels.packed_matmul(mx.zeros((1, 256)), tiles, 8)  # K of 8 blocks, tiles hold 2
    with pytest.raises(ValueError, match="packed weight"):
        kernels.packed_matmul(mx.zeros((1, 64)), tiles, 20)  # more rows than the tile holds
    with pytest.raises(ValueError, match="packed weight"):
        kernels.packed_matmul(mx.zeros((1, 64)), tiles, 8, 8)  # 4-bit tiles read as 8-bit
    with pytest.raises(ValueError, match="bits"):
        kernels.packed_matmul(mx.zeros((1, 64)), tiles, 8, 3)
    with pytest.raises(ValueError, match="float32"):
        kernels.packed_matmul(mx.zeros((1, 64), dtype=mx.float16), tiles, 8)


def test_untiled_layers_keep_their_layout(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scales float16 cannot hold exactly, or the int8 path off, keep MLX's layout."""
    from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

    assert isinstance(_not_half_exact_layer(kernels), KernelQuantizedLinear)
    monkeypatch.setattr(kernels, "int8", lambda: False)
    model = nn.Sequential(nn.Linear(64, 16))
    nn.quantize(model, group_size=32, bits=8)
    model.layers[0].scales = model.layers[0].scales.astype(mx.float16)
    model.layers[0].biases = model.layers[0].biases.astype(mx.float16)
    assert use_cpu_kernels(model, kernels, dense=False) == 1
    assert isinstance(model.layers[0], KernelQuantizedLinear)


def test_tiled_layer_keeps_its_bias_and_repr(kernels: ModuleType) -> None:
    from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

    if not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    model = nn.Sequential(nn.Linear(64, 10))
    nn.quantize(model, group_size=32, bits=4)
    layer = model.layers[0]
    layer.scales = layer.scales.astype(mx.float16)  # as GGUF stores them
    layer.biases = layer.biases.astype(mx.float16)
    layer.bias = mx.arange(10, dtype=mx.float32)
    x = mx.random.normal((2, 64), key=mx.random.key(5))
    want = np.array(layer(x))
    assert use_cpu_kernels(model, kernels, dense=True) == 1
    tiled = model.layers[0]
    assert isinstance(tiled, KernelPackedLinear) and "weight" not in tiled
    assert "dense" not in tiled  # the tiles serve prefill too: no float32 copy
    got = np.array(tiled(x))
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    assert "input_dims=64, output_dims=10" in repr(model)


def test_rms_norm_op_matches_mlx(kernels: ModuleType) -> None:
    from mlxcel.engine.cpu_kernels.layers import KernelRMSNorm, use_norm_kernel

    model = nn.Sequential(nn.RMSNorm(96, eps=1e-5), nn.RMSNorm(40, eps=1e-6))
    model.layers[0].weight = mx.random.normal((96,), key=mx.random.key(2))
    xs = [mx.random.normal((3, 5, 96), key=mx.random.key(3)), mx.random.normal((2, 40))]
    want = [np.array(model.layers[0](xs[0])), np.array(model.layers[1](xs[1]))]
    assert use_norm_kernel(model, kernels) == 2
    assert isinstance(model.layers[0], KernelRMSNorm)
    np.testing.assert_allclose(np.array(model.layers[0](xs[0])), want[0], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.array(model.layers[1](xs[1])), want[1], atol=2e-6, rtol=1e-5)
    # not float32: MLX's own rms_norm
    half = xs[1].astype(mx.float16)
    expected = mx.fast.rms_norm(half, model.layers[1].weight, 1e-6)
    assert mx.array_equal(model.layers[1](half), expected)
    with pytest.raises(ValueError, match="float32"):
        kernels.rms_norm(xs[1], mx.ones((41,)), 1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_read_from_the_int8_tiles_equal_mlx_embedding_lookups(bits: int) -> None:
    """A tiled embedding keeps no MLX copy of its table: `tile_rows` gives exactly the rows
    `nn.QuantizedEmbedding` dequantizes, a partial last tile and repeated ids included."""
    vocab, dims = 45, 96  # 45 rows: two full tiles of 16 and a partial one
    embedding = nn.QuantizedEmbedding.from_embedding(
        _random_embedding(vocab, dims), group_size=32, bits=bits
    )
    embedding.scales = embedding.scales.astype(mx.float16).astype(mx.float32)
    embedding.biases = embedding.biases.astype(mx.float16).astype(mx.float32)
    tiles = pack_int8(embedding.weight, embedding.scales, embedding.biases, 32, bits)
    ids = mx.array([[0, 15, 16, 44], [44, 3, 3, 31]])
    expected = embedding(ids).astype(mx.float32)
    got = tile_rows(tiles, ids, bits, dims)
    assert got.shape == (2, 4, dims)
    assert mx.array_equal(got, expected)


def _random_embedding(vocab: int, dims: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab, dims)
    embedding.weight = mx.random.normal((vocab, dims), key=mx.random.key(7))
    return embedding


@pytest.mark.parametrize("tiled", [False, True])
def test_tied_head_uses_the_kernel_and_decode_matches_batch(
    kernels: ModuleType, tiny_qwen3_dir: Path, tiled: bool
) -> None:
    """qwen3 ties its LM head to the embedding: `as_linear` runs on the kernel (on the int8
    tiles when its scales are float16, as GGUF's are; lookups read the same tiles)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.engine.cpu_kernels.layers import KernelPackedEmbedding, use_cpu_kernels
    from mlxcel.engine.loading import load_model

    if tiled and not kernels.int8():
        pytest.skip("this CPU has no AVX-512 VNNI: there are no int8 tiles")
    loaded = load_model(str(tiny_qwen3_dir), cpu_dtype="keep")
    nn.quantize(loaded.model, group_size=32, bits=4)
    if tiled:
        for _, module in loaded.model.named_modules():
            if "scales" in module:
                module["scales"] = module["scales"].astype(mx.float16)
                module["biases"] = module["biases"].astype(mx.float16)
    assert use_cpu_kernels(loaded.model, kernels, dense=False) > 0
    head = KernelPackedEmbedding if tiled else KernelQuantizedEmbedding
    assert _count(loaded.model, head) == 1
    model = loaded.model
    prompts = [[5, 9, 14], [7, 3, 22]]
    # two sequences decoded together give the same logits as each decoded alone
    together = model(mx.array(prompts), cache=make_prompt_cache(model))
    for i, prompt in enumerate(prompts):
        alone = model(mx.array([prompt]), cache=make_prompt_cache(model))
        assert np.array_equal(np.array(alone[0, -1]), np.array(together[i, -1]))


def test_off_switch_falls_back_to_float32(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.engine.loading import load_model

    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv(process_env.CPU_KERNELS, "off")
    loaded = load_model(str(tiny_gguf), cpu_dtype="auto")
    assert _count(loaded.model, KernelQuantizedLinear) == 0
    assert loaded.info.quantization.endswith("→ float32")
    assert (
        build.kernel_status() == f"mlxcel CPU kernels unavailable: off ({process_env.CPU_KERNELS})"
    )


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setenv(process_env.KERNEL_DIR, str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler"):
        build.build()
    assert build.load_kernels() is None
    assert "no C++ compiler" in build.kernel_status()


def test_threads_setting_reaches_the_kernel(
    kernels: ModuleType, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-t/--threads` (load_model's cpu_threads) sets the pool; -1 keeps the default."""
    from mlxcel.engine.loading import load_model

    assert 1 <= build.default_threads() <= 8
    before = kernels.threads()
    try:
        load_model(str(tiny_gguf), cpu_dtype="auto", cpu_threads=3)
        assert kernels.threads() == 3
        kernels.set_threads(before)
        load_model(str(tiny_gguf), cpu_dtype="auto", cpu_threads=-1)
        assert kernels.threads() == before
    finally:
        kernels.set_threads(before)


@pytest.fixture(scope="module")
def tiny_q4_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny_models import write_tiny_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    return write_tiny_gguf(tiny_llama_dir, out, "Q4_1")


def test_bench_reports_the_kernel(kernels: ModuleType, tiny_q4_gguf: Path) -> None:
    import json

    from mlxcel.commands import bench
    from typer.testing import CliRunner

    args = ["-m", str(tiny_q4_gguf), "-p", "8", "-n", "2", "-r", "1", "-t", "2", "--json"]
    result = CliRunner().invoke(bench.app, args)
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    assert "mlxcel CPU kernel" in model["quantization"]
    int8 = f", int8 {kernels.int8_simd}" if kernels.int8() else ""
    assert model["cpu_kernels"] == f"mlxcel CPU kernels ({kernels.simd}{int8}, 2 threads)"


def _served_alone_and_together(serve_args: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Four greedy completions through a real `mlxcel serve`: one at a time, then together."""
    from concurrent.futures import ThreadPoolExecutor

    from server_harness import ServeProcess

    prompts = ["hello world", "the quick brown fox", "one two three", "a b c d e"]
    with ServeProcess(serve_args) as server, server.client(timeout=120) as client:

        def complete(prompt: str) -> list[int]:
            body = {"prompt": prompt, "n_predict": 12, "temperature": 0, "ignore_eos": True}
            body["return_tokens"] = True
            reply = client.post("/completion", json=body)
            assert reply.status_code == 200, reply.text
            return list(reply.json()["tokens"])

        alone = [complete(p) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(complete, prompts))
    assert all(len(tokens) == 12 for tokens in alone)
    return alone, together


def test_served_batch_equals_each_request_alone(kernels: ModuleType, tiny_q4_gguf: Path) -> None:
    """Through a real `mlxcel serve` on Q4_1 weights: /props names the kernel, and four
    greedy completions decoded together equal the same prompts decoded one at a time."""
    from server_harness import ServeProcess

    args = ["-m", str(tiny_q4_gguf), "-np", "4", "-c", "1024", "-t", "3"]
    with ServeProcess(args) as server, server.client(timeout=120) as client:
        props = client.get("/props").json()
        assert props["cpu_kernels"].startswith("mlxcel CPU kernels (")
        assert props["cpu_kernels"].endswith(", 3 threads)")  # -t/--threads
    alone, together = _served_alone_and_together(args)
    assert together == alone


@pytest.mark.parametrize("fast_blas", [True, False])
def test_float32_prefill_copy_only_with_a_real_blas(
    float_activations: ModuleType,
    tiny_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    fast_blas: bool,
) -> None:
    """Untiled layers (here: the int8 path off) get a float32 copy for prefill only with a
    real BLAS: MLX's bundled reference BLAS is slower than the kernel even for prefill."""
    from mlxcel.engine.loading import load_model, resolve

    monkeypatch.setattr(resolve, "_fast_blas", lambda: fast_blas)
    loaded = load_model(str(tiny_gguf), cpu_dtype="auto")
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, KernelQuantizedLinear)]
    assert layers
    assert all(("dense" in m) is fast_blas for m in layers)
    assert ("float32 for prefill" in loaded.info.quantization) is fast_blas
    ids = mx.array([loaded.tokenizer.encode("hello world " * 8)])
    assert ids.shape[1] > KERNEL_MAX_ROWS
    logits = loaded.model(ids)  # prefill-sized: the kernel alone when there is no copy
    assert np.isfinite(np.array(logits)).all()


def test_threads_split_rows_without_changing_results(kernels: ModuleType) -> None:
    # 4 x 2048 x 512 multiply-adds: above the size the pool leaves on the calling thread
    packed, scales, biases, _ = _weights(2048, 512, 4, 32)
    x = mx.array(np.random.default_rng(4).standard_normal((4, 512)).astype(np.float32))
    before = kernels.threads()
    try:
        kernels.set_threads(1)
        one = np.array(kernels.quantized_matmul(x, packed, scales, biases, 32, 4))
        kernels.set_threads(3)
        assert kernels.threads() == 3
        three = np.array(kernels.quantized_matmul(x, packed, scales, biases, 32, 4))
    finally:
        kernels.set_threads(before)
    assert np.array_equal(one, three)


_VARIANT_CHECK = """
import mlxcel.engine
import mlx.core as mx
import numpy as np
from mlxcel.engine.cpu_kernels import build

k = build.load_kernels()
assert k is not None, build.kernel_status()
for bits in (4, 8):
    for rows in (1, 5):
        rng = np.random.default_rng(bits + rows)
        w = mx.array(rng.standard_normal((48, 128)).astype(np.float32))
        x = mx.array(rng.standard_normal((rows, 128)).astype(np.float32))
        q, s, b = mx.quantize(w, group_size=64, bits=bits)
        ref = x @ mx.dequantize(q, s, b, group_size=64, bits=bits).T
        got = k.quantized_matmul(x, q, s, b, 64, bits)
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-4)
print(k.simd)
"""


@pytest.mark.parametrize(
    ("cflags", "simd"),
    [("-mno-avx512f", "avx2"), ("-mno-avx512f -mno-avx2 -mno-fma", "scalar")],
)
def test_fallback_instruction_sets(kernels: ModuleType, cflags: str, simd: str) -> None:
    """The AVX2 and portable paths, built with the wider instruction sets turned off."""
    import os
    import platform
    import subprocess

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set flags are x86 ones")
    env = {**os.environ, process_env.KERNEL_CFLAGS: cflags}
    done = subprocess.run(
        [sys.executable, "-c", _VARIANT_CHECK], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == simd


def test_linear_layer_with_bias_and_group_64(float_activations: ModuleType) -> None:
    """An MLX-style 4-bit layer (group 64, with a bias, as Qwen2's q/k/v projections)."""
    from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

    kernels = float_activations

    rng = np.random.default_rng(5)
    model = nn.Sequential(nn.Linear(128, 96, bias=True))
    model.layers[0].weight = mx.array(rng.standard_normal((96, 128)).astype(np.float32))
    model.layers[0].bias = mx.array(rng.standard_normal(96).astype(np.float32))
    nn.quantize(model, group_size=64, bits=4)
    x = mx.array(rng.standard_normal((2, 5, 128)).astype(np.float32))
    expected = np.array(model(x))
    assert use_cpu_kernels(model, kernels, dense=False) == 1
    assert isinstance(model.layers[0], KernelQuantizedLinear)
    np.testing.assert_allclose(np.array(model(x)), expected, rtol=1e-4, atol=1e-4)


def test_auto_does_not_use_the_portable_scalar_path(
    kernels: ModuleType, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AVX2 the kernel is not faster than float32 BLAS: `auto` keeps float32."""
    from types import SimpleNamespace

    from mlxcel.engine.loading import load_model

    scalar = SimpleNamespace(simd="scalar", quantized_matmul=kernels.quantized_matmul)
    monkeypatch.setattr(build, "_state", {"module": scalar})
    loaded = load_model(str(tiny_gguf), cpu_dtype="auto")
    assert _count(loaded.model, KernelQuantizedLinear) == 0
    assert loaded.info.quantization.endswith("→ float32")
    assert "not used" in build.kernel_status()


# ------------------------------------------------------- float32 weights and rotary embedding


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_dense_matmul_matches_blas_and_rows_stay_identical(kernels: ModuleType, rows: int) -> None:
    width = int(kernels.simd_width)
    rng = np.random.default_rng(rows)
    k, n = 40 * width, 97
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    x = mx.array(rng.standard_normal((rows, 1, k)).astype(np.float32))
    got = np.array(kernels.dense_matmul(x, w))
    np.testing.assert_allclose(got, np.array(x @ w.T), atol=1e-4, rtol=1e-4)
    assert got.shape == (rows, 1, n)
    alone = np.array(kernels.dense_matmul(x[rows - 1 :], w))
    assert np.array_equal(alone[0], got[rows - 1])  # the same order of operations per row
    with pytest.raises(ValueError, match="multiple of the SIMD width"):
        kernels.dense_matmul(x[..., 1:], w[:, 1:])


def _address(a: mx.array) -> int:
    return int(np.array(a, copy=False).ctypes.data)


def _misaligned(a: mx.array) -> mx.array:
    """`a`'s values in a view whose data does not start on a 64-byte boundary."""
    flat = mx.concatenate([mx.zeros((2,), a.dtype), a.reshape(-1)])
    mx.eval(flat)
    start = 1 if (_address(flat) + a.itemsize) % 64 else 2
    view = flat[start : start + a.size].reshape(a.shape)
    mx.eval(view)
    assert _address(view) % 64 != 0
    return view


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.uint8, mx.uint32])
def test_aligned_puts_the_data_on_a_cache_line(dtype: mx.Dtype) -> None:
    a = _misaligned((mx.arange(3 * 517) % 200).astype(dtype).reshape(3, 517))
    b = aligned(a)
    assert _address(b) % 64 == 0
    assert b.shape == a.shape and b.dtype == a.dtype
    assert mx.array_equal(a, b).item()
    assert aligned(b) is b  # already aligned: no copy
    bf = mx.ones((4, 8), mx.bfloat16)
    assert aligned(bf) is bf  # NumPy has no bfloat16: left as it is


def test_kernel_layers_hold_cache_line_aligned_weights(
    kernels: ModuleType, tiny_llama_dir: Path, tiny_gguf: Path
) -> None:
    """Every weight the kernel streams starts on a 64-byte boundary (a 64-byte load of a
    misaligned one spans two cache lines)."""
    from mlxcel.engine.cpu_kernels.layers import KernelEmbedding, KernelLinear
    from mlxcel.engine.loading import load_model

    float_model = load_model(str(tiny_llama_dir), cpu_dtype="auto").model
    weights = [
        m["weight"]
        for _, m in float_model.named_modules()
        if isinstance(m, (KernelLinear, KernelEmbedding))
    ]
    assert weights and all(_address(w) % 64 == 0 for w in weights)
    if kernels.int8():
        tiled = load_model(str(tiny_gguf), cpu_dtype="auto").model
        tiles = [m["packed"] for _, m in tiled.named_modules() if "packed" in m]
        assert tiles and all(_address(t) % 64 == 0 for t in tiles)


def test_dense_matmul_is_the_same_on_aligned_and_misaligned_data(kernels: ModuleType) -> None:
    """The kernel copies a misaligned x to a cache line: the same bits either way."""
    width = int(kernels.simd_width)
    rng = np.random.default_rng(7)
    w = _misaligned(mx.array(rng.standard_normal((50, 8 * width)).astype(np.float32)))
    x = _misaligned(mx.array(rng.standard_normal((5, 8 * width)).astype(np.float32)))
    reference = np.array(kernels.dense_matmul(x, w))
    for xs in (x, aligned(x)):
        for ws in (w, aligned(w)):
            assert np.array_equal(np.array(kernels.dense_matmul(xs, ws)), reference)


@pytest.mark.parametrize(
    ("shape", "dims", "traditional", "offset"),
    [
        ((1, 9, 1, 64), 64, False, 70),
        ((4, 3, 1, 64), 64, False, [3, -2, 10, 50]),  # one offset per batch row (padding)
        ((2, 8, 37, 64), 32, True, 5),  # partial rotary, consecutive pairs
        ((1, 4, 200, 32), 32, False, 0),  # a prefill
    ],
)
def test_rope_matches_mlx(
    kernels: ModuleType, shape: tuple[int, ...], dims: int, traditional: bool, offset: object
) -> None:
    b, h, length, d = shape
    x = mx.random.normal((b, length, h, d), key=mx.random.key(1)).transpose(0, 2, 1, 3)
    start = mx.array(offset)
    expected = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=start)
    got = kernels.rope(x, dims, traditional, 10000.0, 0.5, start)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=3e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="offset"):
        kernels.rope(x, dims, traditional, 10000.0, 0.5, mx.array([1, 2, 3, 4, 5]))


def test_float_models_use_the_kernel_for_decode_and_rope(
    kernels: ModuleType, tiny_llama_dir: Path
) -> None:
    """A float32 model under `auto`: linear layers and rotary embeddings on the kernel, the
    logits those of the plain model for a decode step and for a prefill."""
    from mlxcel.engine.cpu_kernels.layers import KernelLinear, KernelRoPE
    from mlxcel.engine.loading import load_model

    auto = load_model(str(tiny_llama_dir), cpu_dtype="auto")
    plain = load_model(str(tiny_llama_dir), cpu_dtype="keep")
    assert _count(auto.model, KernelLinear) > 0 and _count(auto.model, KernelRoPE) > 0
    assert _count(plain.model, KernelLinear) == _count(plain.model, KernelRoPE) == 0
    assert auto.info.quantization == "float32 (mlxcel CPU kernel for decode)"
    tokens = auto.tokenizer.encode("hello world, the quick brown fox jumps")
    for ids in (tokens[:1], tokens[:4], (tokens * 4)[:30]):
        a = np.array(auto.model(mx.array([ids])))
        b = np.array(plain.model(mx.array([ids])))
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_served_float_batch_equals_each_request_alone(
    kernels: ModuleType, tiny_llama_dir: Path
) -> None:
    """Through a real `mlxcel serve` on float32 weights: four greedy completions decoded
    together equal the same prompts decoded one at a time."""
    alone, together = _served_alone_and_together(["-m", str(tiny_llama_dir), "-np", "4"])
    assert together == alone


def test_round_int8_rounds_as_the_kernel_does(kernels: ModuleType) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 7, 96)).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block stays zero
    x[1, 2, 5] = 40.0  # one large value sets its block's step
    got = np.array(kernels.round_int8(mx.array(x)))
    assert np.array_equal(got, _rounded_x(x.reshape(-1, 96)).reshape(x.shape))
    assert not got[0, 0, :32].any()
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.round_int8(mx.array(x[..., :40]))


def test_gelu_approx_op_is_mlx_gelu_approx_closer_to_exact(kernels: ModuleType) -> None:
    """The tanh-approximate GELU (Gemma's MLPs) as x / (1 + e^(-2u)): within 2e-6 of the
    float64 value of MLX's formula (MLX's own float32 one is within 6e-7), ragged tails,
    saturation and strided input included; `nn.gelu_approx` routes float32 CPU input to it
    and the rest to MLX."""
    from mlxcel.engine.cpu_kernels.activations import use_gelu_kernel

    x = mx.random.normal((3, 70001), key=mx.random.key(0)) * 5
    e = np.array(x).astype(np.float64)
    exact = 0.5 * e * (1 + np.tanh(np.sqrt(2 / np.pi) * (e + 0.044715 * e**3)))
    got = np.array(kernels.gelu_approx(x))
    assert np.abs(got - exact).max() < 2e-6
    edges = mx.array([0.0, 1e-30, 100.0, -100.0, 20.0, -20.0, float("inf")])
    np.testing.assert_allclose(
        np.array(kernels.gelu_approx(edges)), [0, 5e-31, 100, 0, 20, 0, np.inf], atol=1e-30
    )
    strided = x[:, ::3]
    contiguous = mx.array(np.array(strided))
    assert mx.array_equal(kernels.gelu_approx(strided), kernels.gelu_approx(contiguous))
    assert use_gelu_kernel(kernels) and use_gelu_kernel(kernels)  # idempotent
    original = nn.gelu_approx.mlxcel_original  # type: ignore[attr-defined]
    assert not hasattr(original, "mlxcel_original")
    assert mx.array_equal(nn.gelu_approx(x), kernels.gelu_approx(x))
    half = x.astype(mx.float16)
    assert mx.array_equal(nn.gelu_approx(half), original(half))
    np.testing.assert_allclose(np.array(original(x)), got, atol=2e-6)


def test_gemma_offset_rms_norm_runs_as_one_kernel_op(kernels: ModuleType) -> None:
    """Gemma's `1 + weight` RMS norms (mlx-lm's gemma3_text and gemma2 `RMSNorm`) swap to
    the kernel's one-op norm with `1 + weight` precomputed: MLX's result within float32
    rounding, the parameters unchanged, float16 input on MLX's own path."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma2, gemma3_text

    from mlxcel.engine.cpu_kernels.layers import KernelOffsetRMSNorm, use_norm_kernel

    model = nn.Sequential(gemma3_text.RMSNorm(640, eps=1e-6), gemma2.RMSNorm(96), nn.RMSNorm(8))
    model.layers[0].weight = mx.random.normal((640,), key=mx.random.key(4))
    xs = [mx.random.normal((2, 3, 640), key=mx.random.key(5)), mx.random.normal((4, 96))]
    want = [np.array(model.layers[i](xs[i])) for i in range(2)]
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert use_norm_kernel(model, kernels) == 3
    assert [name for name, _ in tree_flatten(model.parameters())] == names
    for i in range(2):
        assert isinstance(model.layers[i], KernelOffsetRMSNorm)
        np.testing.assert_allclose(np.array(model.layers[i](xs[i])), want[i], atol=2e-6, rtol=1e-5)
    half = xs[0].astype(mx.float16)
    expected = mx.fast.rms_norm(half, 1.0 + model.layers[0].weight, 1e-6)
    assert mx.array_equal(model.layers[0](half), expected)


def test_non_contiguous_inputs_are_gathered_exactly(kernels: ModuleType) -> None:
    """Inputs that are views (a [B, L, H, D] -> [B, H, L, D] transpose, as mlx-lm's q and k
    reach their norms, or a strided last axis) give what their row-contiguous copies give."""
    x = mx.random.normal((2, 7, 4, 64), key=mx.random.key(9))
    weight = mx.random.normal((64,), key=mx.random.key(10))
    for view in (x.transpose(0, 2, 1, 3), x[..., ::2].transpose(0, 2, 1, 3)):
        copy = mx.array(np.array(view))
        w = weight[: view.shape[-1]]
        assert mx.array_equal(kernels.rms_norm(view, w, 1e-6), kernels.rms_norm(copy, w, 1e-6))
        assert mx.array_equal(kernels.silu(view), kernels.silu(copy))
