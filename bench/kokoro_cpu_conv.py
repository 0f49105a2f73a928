"""Kokoro-82M's decoder on the CPU: MLX's own convolutions against the matrix-product ones
(`mlxcel.engine.audio.cpu_conv`), in one run.

Kokoro-82M's weights cannot be fetched here, so the decoder is built at its size (mlx-audio's
`Decoder` with Kokoro-82M's vocoder config: upsampling 10 and 6, residual kernels 3, 7 and
11 dilated 1, 3, 5) with seeded random weights, and fed `--frames` frames of random features:
40 frames are a second of speech, whatever the weights. Prints the seconds per run of each
and the ratio.

    .venv/bin/python bench/kokoro_cpu_conv.py [--frames 72] [-r ROUNDS]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import load_note  # noqa: E402

import mlxcel.engine  # noqa: E402,F401  (a real BLAS under MLX before mlx.core loads)

FRAMES_PER_SECOND = 40
KOKORO_82M_VOCODER = {
    "resblock_kernel_sizes": [3, 7, 11],
    "upsample_rates": [10, 6],
    "upsample_initial_channel": 512,
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "upsample_kernel_sizes": [20, 12],
    "gen_istft_n_fft": 20,
    "gen_istft_hop_size": 5,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=72, help="decoder frames (40 per second)")
    parser.add_argument("-r", "--rounds", type=int, default=2)
    args = parser.parse_args()
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_audio.tts.models.kokoro.istftnet import Decoder

    from mlxcel.engine.audio.cpu_conv import use_matmul_convs

    mx.random.seed(0)
    decoder = Decoder(dim_in=512, style_dim=128, dim_out=80, **KOKORO_82M_VOCODER)

    def scaled(value: mx.array) -> mx.array:
        if value.ndim < 2:
            return value
        fan_in = max(1, value.size // value.shape[0])
        return mx.random.uniform(-1.0, 1.0, value.shape) / fan_in**0.5

    decoder.update(tree_map(scaled, decoder.parameters()))
    frames = args.frames
    features = mx.random.normal((1, 512, frames))
    f0 = mx.abs(mx.random.normal((1, 2 * frames))) * 100 + 100
    noise = mx.random.normal((1, 2 * frames))
    style = mx.random.normal((1, 128)) * 0.1
    mx.eval(decoder.parameters(), features, f0, noise, style)

    def timed(rounds: int) -> tuple[float, int]:
        best, samples = float("inf"), 0
        for _ in range(rounds):
            start = time.perf_counter()
            audio = decoder(features, f0, noise, style)
            mx.eval(audio)
            best = min(best, time.perf_counter() - start)
            samples = audio.size
        return best, samples

    speech = frames / FRAMES_PER_SECOND
    print(f"Kokoro-82M-sized decoder, {frames} frames ({speech:.1f} s of speech; {load_note()})")
    before, _ = timed(1)  # MLX's loops are slow: one round
    print(f"  MLX convolutions            {before:7.2f} s  ({before / speech:5.1f}x real time)")
    use_matmul_convs(decoder)
    after, samples = timed(args.rounds)
    print(f"  matrix-product convolutions {after:7.2f} s  ({after / speech:5.1f}x real time)")
    print(f"  {before / after:.1f}x faster; {samples / 24_000:.2f} s of audio out")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
