"""Generate or edit pictures with an image model (Z-Image, FLUX.2-klein) through mflux."""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mlxcel.config import process_env

from .common import PROFILE_OPTION, fail, resolve, utf8_text

if TYPE_CHECKING:
    from mlxcel.engine.image import GeneratedPicture, ImageModel, ImageRequest

MODEL_ENV = process_env.IMAGE_MODEL


def _read_images(paths: list[str]) -> list[bytes]:
    """Every --image file, checked to be a picture before any model loads."""
    from mlxcel.engine.errors import InvalidRequestError
    from mlxcel.engine.image import check_input_image

    images = []
    for name in paths:
        try:
            data = Path(name).read_bytes()
        except IsADirectoryError:
            fail(f"--image {name} is a directory, not a picture")
        except OSError as exc:
            fail(f"cannot read {name}: {exc.strerror or exc}")
        try:
            check_input_image(data, name)
        except InvalidRequestError as exc:
            fail(str(exc))
        images.append(data)
    return images


def output_paths(output: str, n: int) -> list[Path]:
    """`output` for one image; `STEM-1.png` ... `STEM-n.png` beside it for several."""
    path = Path(output)
    if path.is_dir():
        fail(f"-o {output} is a directory; give a file name such as {path / 'image.png'}")
    if n == 1:
        return [path]
    suffix = path.suffix or ".png"
    return [path.with_name(f"{path.stem}-{i + 1}{suffix}") for i in range(n)]


def _load(ref: str, quiet: bool) -> ImageModel:
    from rich.console import Console

    from mlxcel.engine.errors import EngineError
    from mlxcel.engine.image import load_image_model

    console = Console(stderr=True)
    try:
        if quiet or not console.is_terminal:
            return load_image_model(ref)
        with console.status(f"loading {ref}…"):
            return load_image_model(ref)
    except EngineError as exc:
        fail(str(exc))


def _run(model: ImageModel, job: ImageRequest, quiet: bool) -> list[GeneratedPicture]:
    """Generate, with a progress bar over the denoising steps on a terminal."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from mlxcel.engine.errors import EngineError

    console = Console(stderr=True)
    try:
        if quiet or not console.is_terminal:
            return model.generate(job)
        columns: list[Any] = [
            TextColumn("[bold]denoising"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("denoising", total=model.steps_of(job) * job.n)
            return model.generate(
                job, on_step=lambda done, total: bar.update(task, completed=done, total=total)
            )
    except EngineError as exc:
        fail(str(exc))


def image(
    prompt: str = typer.Argument(..., help="What to draw (or, with --image, how to change it)."),
    output: str = typer.Option(
        "image.png", "--output", "-o", help="PNG file to write (several: FILE-1.png, ...)."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help=f"Image model directory (a diffusers snapshot); default: ${MODEL_ENV} or the "
        "profile's image_model.",
    ),
    size: str = typer.Option("1024x1024", "--size", "-s", help="WIDTHxHEIGHT, multiples of 16."),
    steps: int | None = typer.Option(
        None, "--steps", help="Denoising steps; default: the family's (Z-Image 9, FLUX.2 4)."
    ),
    seed: int | None = typer.Option(None, "--seed", help="Seed (image i uses seed + i)."),
    n: int = typer.Option(1, "--n", "-n", help="Number of images (1-10)."),
    images: list[str] = typer.Option(
        [],
        "--image",
        "-i",
        help="Input picture: img2img, or a reference to edit (repeat for several; FLUX.2).",
    ),
    strength: float | None = typer.Option(
        None,
        "--strength",
        help="With --image: share of the steps the input replaces (0-1; higher keeps more).",
    ),
    guidance: float | None = typer.Option(
        None, "--guidance", help="Guidance scale; default: the family's."
    ),
    negative_prompt: str | None = typer.Option(
        None, "--negative-prompt", help="What to avoid (Z-Image with guidance > 1)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object for scripts."),
    profile: str | None = PROFILE_OPTION,
) -> None:
    """Generate pictures from a prompt (or edit --image pictures) and write PNG files."""
    from mlxcel.engine.errors import InvalidRequestError
    from mlxcel.engine.image import ImageRequest, parse_size

    settings = resolve(profile, {"image_model": model}).settings
    ref = settings.image_model
    if not ref:
        fail(f"no image model: pass --model DIR, or set {MODEL_ENV} (or image_model in a profile)")
    try:
        width, height = parse_size(size)
    except InvalidRequestError as exc:
        fail(f"--size: {exc}")
    utf8_text(prompt, "the prompt")
    if negative_prompt is not None:
        utf8_text(negative_prompt, "--negative-prompt")
    job = ImageRequest(
        prompt=prompt,
        width=width,
        height=height,
        n=n,
        seed=secrets.randbelow(2**31) if seed is None else seed,
        steps=steps,
        guidance=guidance,
        negative_prompt=negative_prompt,
        images=[],
        strength=strength,
    )
    job.images = _read_images(images)
    try:
        job.check()
    except InvalidRequestError as exc:
        fail(str(exc))
    paths = output_paths(output, n)
    loaded = _load(ref, quiet=as_json)
    try:
        loaded.check(job)
    except InvalidRequestError as exc:
        fail(str(exc))
    started = time.perf_counter()
    pictures = _run(loaded, job, quiet=as_json)
    seconds = time.perf_counter() - started
    for path, picture in zip(paths, pictures, strict=True):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(picture.png)
        except OSError as exc:
            fail(f"cannot write {path}: {exc.strerror or exc}")
    if as_json:
        print(json.dumps(_payload(loaded, job, paths, pictures, seconds)))
        return
    for path, picture in zip(paths, pictures, strict=True):
        print(f"mlxcel: wrote {picture.width}x{picture.height} {path} (seed {picture.seed})")
    print(
        f"mlxcel: {loaded.family.name}, {loaded.steps_of(job)} steps x {n} in {seconds:.1f} s",
        file=sys.stderr,
    )


def _payload(
    model: ImageModel,
    job: ImageRequest,
    paths: list[Path],
    pictures: list[GeneratedPicture],
    seconds: float,
) -> dict[str, Any]:
    return {
        "model": model.name,
        "family": model.family.name,
        "size": f"{job.width}x{job.height}",
        "steps": model.steps_of(job),
        "seconds": round(seconds, 3),
        "images": [
            {"path": str(path), "width": p.width, "height": p.height, "seed": p.seed}
            for path, p in zip(paths, pictures, strict=True)
        ],
    }
