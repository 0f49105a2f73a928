"""The image engine on tiny random-weight mflux pipelines (Z-Image, FLUX.2-klein), in process.

The pipelines are built with mflux's own classes, saved with mflux's ModelSaver and loaded
back through mflux's weight and tokenizer loaders by `load_image_model`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mflux", reason="image generation needs the image extra (mflux)")

from fixtures.tiny_image import FLUX2_TRANSFORMER, Z_IMAGE_TRANSFORMER, png_size, tiny_pipeline_dir

from mlxcel.engine.errors import InvalidRequestError, ModelLoadError, QueueFullError
from mlxcel.engine.image import (
    ImageRequest,
    ImageStoppedError,
    detect_family,
    load_image_model,
    parse_size,
)
from mlxcel.engine.workers.errors import WorkerTimeoutError
from mlxcel.engine.workers.image_worker import ImageWorker


@pytest.fixture(scope="module", autouse=True)
def _no_compile() -> Iterator[None]:
    import mlx.core as mx

    mx.disable_compile()  # mflux compiles its step on Linux; the first call costs 7-40 s
    yield
    mx.enable_compile()


@pytest.fixture(scope="module")
def z_image(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_image_model(str(tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "z-image")))


@pytest.fixture(scope="module")
def klein(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_image_model(str(tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "flux2-klein")))


def test_saved_weights_load_back_through_mflux(z_image: Any, klein: Any) -> None:
    import mlx.core as mx

    assert z_image.family.name == "z-image" and klein.family.name == "flux2-klein"
    assert z_image.pipeline.transformer.dim == Z_IMAGE_TRANSFORMER["dim"]
    assert len(z_image.pipeline.transformer.layers) == Z_IMAGE_TRANSFORMER["n_layers"]
    assert len(klein.pipeline.transformer.transformer_blocks) == FLUX2_TRANSFORMER["num_layers"]
    # what the loader put in the modules is what ModelSaver wrote, value for value
    for model, key, module in (
        (z_image, "cap_embedder.1.weight", z_image.pipeline.transformer.cap_embedder[1].weight),
        (klein, "x_embedder.weight", klein.pipeline.transformer.x_embedder.weight),
    ):
        folder = model.path / "transformer"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        saved = mx.load(str(folder / index["weight_map"][key]))[key]
        assert saved.shape == module.shape
        assert mx.array_equal(saved, module).item()
        assert float(mx.abs(saved.astype(mx.float32)).sum()) > 0  # random, not zeros


def test_z_image_png_of_the_size_and_seed_plus_i(z_image: Any) -> None:
    steps: list[tuple[int, int]] = []
    pair = z_image.generate(
        ImageRequest(prompt="a red cat", width=32, height=16, n=2, seed=7, steps=2),
        on_step=lambda done, total: steps.append((done, total)),
    )
    assert [(p.width, p.height, p.seed) for p in pair] == [(32, 16, 7), (32, 16, 8)]
    assert all(png_size(p.png) == (32, 16) for p in pair)
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert pair[0].png != pair[1].png
    again = z_image.generate(ImageRequest(prompt="a red cat", width=32, height=16, seed=8, steps=2))
    assert again[0].png == pair[1].png  # seed 8 alone == the second image of seed 7, n 2


def test_z_image_img2img_runs_and_starts_from_the_picture(z_image: Any) -> None:
    source = z_image.generate(ImageRequest(prompt="a cat", width=16, height=16, seed=1, steps=2))[0]
    plain = z_image.generate(ImageRequest(prompt="a dog", width=16, height=16, seed=2, steps=4))[0]
    job = ImageRequest(
        prompt="a dog", width=16, height=16, seed=2, steps=4, images=[source.png], strength=0.5
    )
    assert z_image.steps_of(job) == 2
    default = ImageRequest(prompt="a dog", width=16, height=16, steps=10, images=[source.png])
    assert z_image.steps_of(default) == 6  # img2img strength 0.4 unless given
    moved = z_image.generate(job)[0]
    assert png_size(moved.png) == (16, 16)
    assert moved.png != plain.png
    with pytest.raises(InvalidRequestError, match="one input image"):
        z_image.check(ImageRequest(prompt="x", width=16, height=16, images=[source.png] * 2))


def test_flux2_klein_text_to_image_and_multi_reference_edit(klein: Any) -> None:
    first = klein.generate(ImageRequest(prompt="a red cat", width=32, height=16, seed=3, steps=2))[
        0
    ]
    assert png_size(first.png) == (32, 16)
    edit = ImageRequest(
        prompt="make it blue", width=16, height=16, seed=3, steps=2, images=[first.png, first.png]
    )
    edited = klein.generate(edit)[0]
    assert png_size(edited.png) == (16, 16)
    assert klein.generate(edit)[0].png == edited.png


def test_should_stop_ends_the_job_at_the_next_step(z_image: Any) -> None:
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    with pytest.raises(ImageStoppedError, match="after step 1"):
        z_image.generate(
            ImageRequest(prompt="x", width=16, height=16, steps=50, n=3), should_stop=stop
        )


def test_bad_jobs_are_refused_before_any_work(z_image: Any) -> None:
    with pytest.raises(InvalidRequestError, match="multiple of 16"):
        parse_size("30x16")
    with pytest.raises(InvalidRequestError, match="WIDTHxHEIGHT"):
        parse_size("big")
    assert parse_size("auto") == (1024, 1024) and parse_size("48X32") == (48, 32)
    for job, message in (
        (ImageRequest(prompt=" "), "prompt"),
        (ImageRequest(prompt="x", n=11), "n must be"),
        (ImageRequest(prompt="x", strength=0.5), "strength needs an input image"),
        (ImageRequest(prompt="x", steps=0), "steps must be"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            z_image.check(job)
    with pytest.raises(InvalidRequestError, match="not a readable image"):
        z_image.generate(ImageRequest(prompt="x", width=16, height=16, images=[b"not a picture"]))


def test_family_comes_from_model_index(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model_index.json"):
        detect_family(tmp_path)
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(ModelLoadError, match="not supported"):
        detect_family(tmp_path)
    with pytest.raises(ModelLoadError, match="no such directory"):
        load_image_model(str(tmp_path / "missing"))


class _Gate:
    """Runs the real model but holds the first job until released (to fill the queue)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.started = threading.Event()
        self.release = threading.Event()
        self.family = model.family
        self.name = "gate"

    def check(self, job: ImageRequest) -> None:
        self.model.check(job)

    def generate(self, job: ImageRequest, **kw: Any) -> Any:
        self.started.set()
        self.release.wait(30)
        return self.model.generate(job, **kw)


def test_worker_queue_full_and_timeout(z_image: Any) -> None:
    gate = _Gate(z_image)
    worker = ImageWorker(gate, queue_depth=1, timeout=None).start()  # type: ignore[arg-type]
    try:
        job = ImageRequest(prompt="x", width=16, height=16, steps=1)
        running = worker.submit(job)
        assert gate.started.wait(30)
        queued = worker.submit(job)
        with pytest.raises(QueueFullError):
            worker.submit(job)
        gate.release.set()
        assert png_size(running.result(60)[0].png) == (16, 16)
        assert len(queued.result(60)) == 1
    finally:
        worker.stop()
    slow = ImageWorker(z_image, queue_depth=2, timeout=0.05).start()
    try:
        future: Future[Any]
        future = slow.submit(ImageRequest(prompt="x", width=16, height=16, steps=200, n=10))
        with pytest.raises(WorkerTimeoutError, match="timed out"):
            future.result(120)
    finally:
        slow.stop()


def test_a_cancelled_future_stops_its_job_at_the_next_step(z_image: Any) -> None:
    worker = ImageWorker(z_image, queue_depth=2, timeout=None).start()
    try:
        future = worker.submit(ImageRequest(prompt="x", width=16, height=16, steps=200, n=10))
        time.sleep(0.05)
        while worker.pending:  # until the worker has taken the job off its queue
            time.sleep(0.05)
        time.sleep(0.2)
        assert not future.cancel()  # what the server does when its client goes away
        with pytest.raises(ImageStoppedError):
            future.result(300)
        quick = worker.submit(ImageRequest(prompt="x", width=16, height=16, steps=1))
        assert len(quick.result(300)) == 1
        stats = worker.worker.stats
        assert (stats.jobs, stats.failures) == (1, 1)  # the long job stopped, it did not finish
    finally:
        worker.stop()
