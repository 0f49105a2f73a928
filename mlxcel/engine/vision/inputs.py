"""The decoded media of one request, and its content digest for caching."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass
class VisionInputs:
    """Media for one request, in prompt order within each kind.

    `images` are PIL RGB pictures; `audio` are mono float32 arrays at 16 kHz; `videos` are
    lists of PIL frames (the frame fallback) or paths of files the server staged itself.
    """

    images: list[Any] = field(default_factory=list)
    audio: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.images or self.audio or self.videos)

    def digest(self) -> str:
        """A hash of the media content (not of any name), so equal media share cache keys."""
        h = hashlib.sha256()
        for image in self.images:
            h.update(b"image")
            h.update(f"{image.size}{image.mode}".encode())
            _hash_pixels(h, image)
        for clip in self.audio:
            h.update(b"audio")
            h.update(memoryview(clip).tobytes())
        for video in self.videos:
            h.update(b"video")
            if isinstance(video, list):
                for frame in video:
                    _hash_pixels(h, frame)
            else:
                with open(video, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
        return h.hexdigest()


HASH_ROWS = 64
"""Rows of a picture copied out for its digest at a time (one copy holds the GIL)."""


def _hash_pixels(h: Any, image: Any) -> None:
    """Feed `image`'s pixels to `h`, the bytes `image.tobytes()` gives, a strip of rows at a
    time: one copy of a large picture held the GIL for milliseconds."""
    width, height = image.size
    for top in range(0, height, HASH_ROWS):
        h.update(image.crop((0, top, width, min(top + HASH_ROWS, height))).tobytes())


@dataclass
class VisionPrompt:
    """A rendered prompt (with the model's media placeholders) and the media it refers to."""

    text: str
    inputs: VisionInputs = field(default_factory=VisionInputs)
    prepared: Any = field(default=None, repr=False, compare=False)
    """The engine's `PreparedPrompt` once its processor ran (kept so that a caller may run
    the processor ahead, off its own event loop, and submit does not run it again)."""
