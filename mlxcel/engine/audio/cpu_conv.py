"""1-D convolutions as matrix products, for Kokoro on MLX's CPU backend.

MLX's CPU backend runs a plain convolution as a matrix product on the BLAS, but dilated and
transposed ones as direct loops, 50-100x slower: on a 2-core Xeon a 128-channel, kernel-11,
dilation-5 convolution over 480 frames takes 304 ms (3 ms as a product), a 512→256 transposed
one over 120 frames 229 ms (4 ms). Kokoro's vocoder is made of these (its residual blocks
dilate by 3 and 5, its upsampling is transposed), so they were most of a sentence's speech
time. `use_matmul_convs` points a loaded Kokoro model's weight-normalised convolutions
(mlx-audio's `ConvWeighted`, which take the convolution function as an argument) at the
versions here; grouped ones (the depthwise upsampling, already fast) keep MLX's own. For the
CPU only: on a GPU MLX's kernels are used. `MLXCEL_KOKORO_CONV=mlx` keeps MLX's everywhere.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx


def conv1d(
    x: mx.array,
    weight: mx.array,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
) -> mx.array:
    """`mx.conv1d` (x: (N, L, C_in), weight: (C_out, K, C_in)) as one matrix product."""
    import mlx.core as mx

    if groups != 1:
        return mx.conv1d(
            x, weight, stride=stride, padding=padding, dilation=dilation, groups=groups
        )
    out_channels, kernel, in_channels = weight.shape
    if padding:
        x = mx.pad(x, [(0, 0), (padding, padding), (0, 0)])
    span = dilation * (kernel - 1) + 1
    length = (x.shape[1] - span) // stride + 1
    if length <= 0:
        return mx.conv1d(x, weight, stride=stride, dilation=dilation)
    taps = [
        x[:, j * dilation : j * dilation + (length - 1) * stride + 1 : stride, :]
        for j in range(kernel)
    ]
    columns = taps[0] if kernel == 1 else mx.concatenate(taps, axis=-1)
    return columns @ weight.reshape(out_channels, kernel * in_channels).T


def conv_transpose1d(
    x: mx.array,
    weight: mx.array,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
    output_padding: int = 0,
) -> mx.array:
    """`mx.conv_transpose1d` as one matrix product (every input frame times every kernel
    tap) and an overlap-add of the taps, `stride` output frames apart."""
    import mlx.core as mx

    if groups != 1 or dilation != 1:
        return mx.conv_transpose1d(
            x,
            weight,
            stride=stride,
            padding=padding,
            dilation=dilation,
            output_padding=output_padding,
            groups=groups,
        )
    batch, length, _ = x.shape
    out_channels, kernel, in_channels = weight.shape
    blocks = -(-kernel // stride)  # taps grouped by the output block they land in
    if blocks * stride != kernel:
        weight = mx.pad(weight, [(0, 0), (0, blocks * stride - kernel), (0, 0)])
    taps = x @ weight.transpose(2, 1, 0).reshape(in_channels, -1)  # (N, L, K'·C_out)
    taps = taps.reshape(batch, length, blocks, stride, out_channels)
    full = mx.zeros((batch, length + blocks - 1, stride, out_channels), dtype=taps.dtype)
    for block in range(blocks):
        full[:, block : block + length] += taps[:, :, block]
    full = full.reshape(batch, -1, out_channels)
    size = (length - 1) * stride + kernel - 2 * padding + output_padding
    if padding + size > full.shape[1]:
        full = mx.pad(full, [(0, 0), (0, padding + size - full.shape[1]), (0, 0)])
    return full[:, padding : padding + size]


def use_matmul_convs(model: Any) -> int:
    """Point `model`'s `ConvWeighted` layers at the matrix-product convolutions; how many."""
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    count = 0
    for _, module in model.named_modules():
        if type(module) is ConvWeighted:
            module.__class__ = _matmul_conv_weighted()
            count += 1
    return count


def _matmul_for(conv: Any) -> Any:
    import mlx.core as mx

    if conv is mx.conv1d:
        return conv1d
    if conv is mx.conv_transpose1d:
        return conv_transpose1d
    return conv


@functools.cache
def _matmul_conv_weighted() -> type:
    from mlx_audio.tts.models.kokoro.istftnet import ConvWeighted

    class MatmulConvWeighted(ConvWeighted):  # type: ignore[misc]
        """mlx-audio's ConvWeighted with MLX's CPU convolutions swapped for matrix products."""

        def __call__(self, x: mx.array, conv: Any) -> mx.array:
            return super().__call__(x, _matmul_for(conv))

    return MatmulConvWeighted
