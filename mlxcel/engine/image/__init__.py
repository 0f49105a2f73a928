"""Image generation on mflux: checkpoint families, requests, loading and running pipelines."""

from mlxcel.engine.image.families import FAMILIES, FLUX2_KLEIN, Z_IMAGE, ImageFamily, detect_family
from mlxcel.engine.image.pipeline import (
    GeneratedPicture,
    ImageModel,
    ImageStoppedError,
    check_input_image,
    encode_png,
    load_image_model,
)
from mlxcel.engine.image.request import ImageRequest, parse_size

__all__ = [
    "FAMILIES",
    "FLUX2_KLEIN",
    "Z_IMAGE",
    "GeneratedPicture",
    "ImageFamily",
    "ImageRequest",
    "ImageModel",
    "ImageStoppedError",
    "check_input_image",
    "detect_family",
    "encode_png",
    "load_image_model",
    "parse_size",
]
