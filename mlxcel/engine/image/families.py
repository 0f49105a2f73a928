"""The checkpoint families mlxcel serves through mflux, and how a directory names its family.

A diffusers snapshot names its pipeline class in `model_index.json`; that class picks the
family. Component sizes come from each component's `config.json` (the checkpoint's own key
names, matched to mflux's constructor arguments), so one loader serves the real checkpoints
and the tests' tiny ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlxcel.engine.errors import ModelLoadError


@dataclass(frozen=True)
class ImageFamily:
    """One checkpoint family: what it can do and its defaults."""

    name: str
    pipelines: tuple[str, ...]  # model_index.json `_class_name` values
    max_images: int  # input images: 1 = img2img only, more = multi-reference edit
    edit: bool  # reference images steer the picture (not only an img2img start)
    default_steps: int
    default_guidance: float
    description: str


Z_IMAGE = ImageFamily(
    name="z-image",
    pipelines=("ZImagePipeline",),
    max_images=1,
    edit=False,
    default_steps=9,
    default_guidance=0.0,
    description="Z-Image / Z-Image-Turbo: text-to-image, img2img from one image",
)
FLUX2_KLEIN = ImageFamily(
    name="flux2-klein",
    pipelines=("Flux2KleinPipeline", "Flux2Pipeline"),
    max_images=4,
    edit=True,
    default_steps=4,
    default_guidance=1.0,
    description="FLUX.2-klein 4B/9B: text-to-image and multi-reference editing",
)
FAMILIES: tuple[ImageFamily, ...] = (Z_IMAGE, FLUX2_KLEIN)


def read_json(path: Path) -> dict[str, object]:
    """A JSON object from `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path.parent.name}/{path.name}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def detect_family(root: Path) -> ImageFamily:
    """The family of the checkpoint directory `root` (ModelLoadError when unknown)."""
    index = read_json(root / "model_index.json")
    pipeline = index.get("_class_name")
    if not pipeline:
        raise ModelLoadError(
            f"{root.name}: no model_index.json naming the pipeline; an image model is a diffusers "
            "snapshot of " + " or ".join(f.name for f in FAMILIES)
        )
    for family in FAMILIES:
        if pipeline in family.pipelines:
            return family
    known = ", ".join(p for f in FAMILIES for p in f.pipelines)
    raise ModelLoadError(f"{root.name}: pipeline {pipeline} is not supported (supported: {known})")
