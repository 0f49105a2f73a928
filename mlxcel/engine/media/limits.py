"""The caps on one media item, shared by the server's requests and the CLI's files."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Largest sizes of one image, audio clip or video, and the most pixels of a picture."""

    max_image_bytes: int = 20 * MiB
    max_audio_bytes: int = 25 * MiB
    max_video_bytes: int = 200 * MiB
    max_image_pixels: int = 50_000_000

    def max_bytes(self, kind: str) -> int:
        """The size cap for one media item of `kind` (image, audio, video)."""
        return {
            "image": self.max_image_bytes,
            "audio": self.max_audio_bytes,
            "video": self.max_video_bytes,
        }[kind]
