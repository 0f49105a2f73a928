"""Decoding image bytes into a bounded RGB picture."""

from __future__ import annotations

import io
import warnings
from typing import Any

from mlxcel.engine.media.errors import MediaError


def decode_image(data: bytes, max_pixels: int) -> Any:
    """A PIL RGB image from `data`, refusing pictures over `max_pixels` before decoding them."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(f"image is {width}x{height}, over the {max_pixels}-pixel limit")
            image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaError("image data is not a decodable image within the pixel limit") from None
    except (OSError, ValueError, SyntaxError):
        raise MediaError("image data is corrupt or truncated") from None
    return image.convert("RGB")
