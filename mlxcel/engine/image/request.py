"""What one image request asks for, checked before any model work."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlxcel.engine.errors import InvalidRequestError

SIZE_STEP = 16
"""mflux silently rounds width and height down to a multiple of 16; we refuse instead."""
MIN_SIDE = 16
MAX_SIDE = 4096
MAX_IMAGES = 10
MAX_STEPS = 200
MAX_SEED = 2**32 - 1
DEFAULT_SIZE = (1024, 1024)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


def parse_size(text: str | None, default: tuple[int, int] = DEFAULT_SIZE) -> tuple[int, int]:
    """`WIDTHxHEIGHT` (or `auto`/None: `default`) as (width, height), each a multiple of 16."""
    if text is None or text.strip().lower() == "auto":
        return default
    match = _SIZE_RE.match(text)
    if match is None:
        raise InvalidRequestError(
            f"size must be WIDTHxHEIGHT (for example 1024x1024), not {text!r}"
        )
    width, height = int(match.group(1)), int(match.group(2))
    for name, side in (("width", width), ("height", height)):
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise InvalidRequestError(
                f"size {text.strip()}: {name} must be between {MIN_SIDE} and {MAX_SIDE}"
            )
        if side % SIZE_STEP:
            raise InvalidRequestError(
                f"size {text.strip()}: {name} must be a multiple of {SIZE_STEP} "
                f"(the nearest are {side // SIZE_STEP * SIZE_STEP} and "
                f"{(side // SIZE_STEP + 1) * SIZE_STEP})"
            )
    return width, height


@dataclass
class ImageRequest:
    """One request: `n` images of `width` x `height`, the i-th with seed `seed + i`.

    `images` are encoded input pictures (PNG, JPEG, WebP...): one is img2img, several are
    reference images for an edit model. `strength` is mflux's image strength: the share of
    the denoising steps the input image replaces (0 < strength < 1; higher keeps more of it).
    `steps` and `guidance` None take the family's defaults.
    """

    prompt: str
    width: int = DEFAULT_SIZE[0]
    height: int = DEFAULT_SIZE[1]
    n: int = 1
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    images: list[bytes] = field(default_factory=list)
    strength: float | None = None

    def check(self) -> None:
        """Raise InvalidRequestError on anything out of range (the family is checked later)."""
        if not self.prompt or not self.prompt.strip():
            raise InvalidRequestError("prompt must be a non-empty string")
        if not 1 <= self.n <= MAX_IMAGES:
            raise InvalidRequestError(f"n must be between 1 and {MAX_IMAGES}, got {self.n}")
        if not 0 <= self.seed <= MAX_SEED - (self.n - 1):
            raise InvalidRequestError(f"seed must be between 0 and {MAX_SEED - (self.n - 1)}")
        if self.steps is not None and not 1 <= self.steps <= MAX_STEPS:
            raise InvalidRequestError(f"steps must be between 1 and {MAX_STEPS}, got {self.steps}")
        if self.guidance is not None and not 0 <= self.guidance <= 50:
            raise InvalidRequestError(f"guidance must be between 0 and 50, got {self.guidance}")
        if self.strength is not None:
            if not self.images:
                raise InvalidRequestError("strength needs an input image")
            if not 0 < self.strength < 1:
                raise InvalidRequestError(
                    f"strength must be between 0 and 1 (exclusive), got {self.strength}"
                )
        for side in (self.width, self.height):
            if side % SIZE_STEP or not MIN_SIDE <= side <= MAX_SIDE:
                raise InvalidRequestError(
                    f"width and height must be multiples of {SIZE_STEP} between "
                    f"{MIN_SIDE} and {MAX_SIDE}"
                )
