"""Per-step time of the tiny random-weight Z-Image pipeline the tests use, on this machine.

Builds the pipeline of tests/fixtures/tiny_image.py (mflux classes: a 1-layer transformer of
width 64, a 2-layer text encoder, the real-size VAE) in a temporary directory, loads it with
`mlxcel.engine.image.load_image_model`, and times `generate` at each size with 1 and
1 + K denoising steps (median of the repetitions). One step is the difference over K; the
rest (prompt encoding, VAE decode, PNG) is the 1-step time less one step. It prints the
ratio decode / step too, which says where the time of a tiny job goes, and which BLAS ran.
mx.compile is off, as in the tests (the first compiled call costs 7-40 s on Linux).

    .venv/bin/python bench/image_steps.py [-r REPS] [-k STEPS] [--sizes 16x16,64x64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from _common import load_note  # noqa: E402

import mlxcel.engine  # noqa: E402,F401  (the BLAS under MLX that mlxcel sets up)


def _time(model: object, job: object, reps: int) -> float:
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        model.generate(job)  # type: ignore[attr-defined]
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("-k", "--steps", type=int, default=8)
    parser.add_argument("--sizes", default="16x16,64x64")
    args = parser.parse_args()

    import mlx.core as mx
    from fixtures.tiny_image import build_tiny_z_image

    from mlxcel.engine.blas import blas_in_use
    from mlxcel.engine.image import ImageRequest, load_image_model, parse_size

    mx.disable_compile()
    with tempfile.TemporaryDirectory() as folder:
        model = load_image_model(str(build_tiny_z_image(Path(folder) / "tiny-z-image")))
        print(f"tiny Z-Image, mx.compile off, BLAS: {blas_in_use()}; {load_note()}")
        for text in args.sizes.split(","):
            width, height = parse_size(text)
            one = ImageRequest(prompt="a red cat", width=width, height=height, steps=1)
            many = ImageRequest(
                prompt="a red cat", width=width, height=height, steps=1 + args.steps
            )
            model.generate(one)  # warm-up
            t_one = _time(model, one, args.reps)
            t_many = _time(model, many, args.reps)
            step = max(t_many - t_one, 0.0) / args.steps
            rest = max(t_one - step, 0.0)
            ratio = rest / step if step > 0 else float("inf")
            print(
                f"{width}x{height}: {step * 1000:.1f} ms/step, prompt+decode+png "
                f"{rest * 1000:.0f} ms ({ratio:.1f}x a step)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
