"""Kokoro's convolutions as matrix products on the CPU (mlxcel.engine.audio.cpu_conv)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures.audio import tiny_kokoro_dir

from mlxcel.engine.audio import cpu_conv
from mlxcel.engine.audio.tts import load_kokoro, synthesize


def _random(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# (frames, in, out, kernel, stride, padding, dilation)
CONVS = [
    (60, 70, 32, 3, 1, 1, 1),
    (61, 8, 5, 7, 1, 3, 1),
    (40, 16, 16, 3, 1, 3, 3),
    (48, 6, 6, 11, 1, 25, 5),
    (33, 4, 6, 3, 2, 1, 1),
    (20, 1, 1, 3, 2, 1, 1),
    (10, 4, 4, 1, 1, 0, 1),
]


@pytest.mark.parametrize(("frames", "cin", "cout", "kernel", "stride", "pad", "dil"), CONVS)
def test_conv1d_is_mlx_conv1d(
    frames: int, cin: int, cout: int, kernel: int, stride: int, pad: int, dil: int
) -> None:
    x, w = _random((2, frames, cin), 1), _random((cout, kernel, cin), 2)
    want = mx.conv1d(x, w, stride=stride, padding=pad, dilation=dil)
    got = cpu_conv.conv1d(x, w, stride=stride, padding=pad, dilation=dil)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


# (frames, in, out, kernel, stride, padding, output_padding): Kokoro's upsampling (k = 2u)
# and kernels that are not a multiple of the stride
TRANSPOSED = [
    (30, 16, 8, 4, 2, 1, 0),
    (12, 8, 6, 20, 10, 5, 0),
    (13, 3, 5, 12, 6, 3, 0),
    (9, 4, 4, 3, 1, 1, 0),
    (9, 4, 4, 3, 2, 1, 1),
    (7, 5, 3, 5, 3, 0, 0),
]


@pytest.mark.parametrize(("frames", "cin", "cout", "kernel", "stride", "pad", "extra"), TRANSPOSED)
def test_conv_transpose1d_is_mlx_conv_transpose1d(
    frames: int, cin: int, cout: int, kernel: int, stride: int, pad: int, extra: int
) -> None:
    x, w = _random((2, frames, cin), 3), _random((cout, kernel, cin), 4)
    want = mx.conv_transpose1d(x, w, stride=stride, padding=pad, output_padding=extra)
    got = cpu_conv.conv_transpose1d(x, w, stride=stride, padding=pad, output_padding=extra)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_input_shorter_than_the_kernel_is_mlxs_error() -> None:
    x, w = _random((1, 2, 3), 7), _random((3, 5, 3), 8)
    with pytest.raises(ValueError, match="cannot be smaller"):
        cpu_conv.conv1d(x, w)


def test_grouped_convolutions_keep_mlx_kernels() -> None:
    x, w = _random((1, 12, 6), 5), _random((6, 3, 1), 6)
    want = mx.conv_transpose1d(x, w, stride=2, padding=1, groups=6)
    got = cpu_conv.conv_transpose1d(x, w, stride=2, padding=1, groups=6)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_kokoro_speaks_the_same_through_the_matmul_convolutions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert mx.default_device() == mx.cpu
    swapped = load_kokoro(str(tiny_kokoro_dir()))
    layers = [m for _, m in swapped.model.named_modules() if "ConvWeighted" in type(m).__name__]
    assert layers and all(type(m).__name__ == "MatmulConvWeighted" for m in layers)
    monkeypatch.setenv("MLXCEL_KOKORO_CONV", "mlx")
    plain = load_kokoro(str(tiny_kokoro_dir()))
    assert not any(type(m).__name__ == "MatmulConvWeighted" for _, m in plain.model.named_modules())
    text = "The capital of France is Paris, a city on the Seine."
    fast, slow = synthesize(swapped, text), synthesize(plain, text)
    assert fast.samples.shape == slow.samples.shape and fast.samples.size > 0
    np.testing.assert_allclose(fast.samples, slow.samples, atol=2e-3)
