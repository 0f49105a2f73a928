"""The media access policy, built once when the server starts."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.server.media.addresses import AddressPredicate, is_public_address

log = logging.getLogger("mlxcel.media")

ALLOW_PRIVATE_ENV = "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS"
VIDEO_ALLOWLIST_ENV = "MLXCEL_VIDEO_DIR_ALLOWLIST"

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> the addresses it resolves to, as text."""

MiB = 1024 * 1024


async def system_resolver(host: str, port: int) -> list[str]:
    """Resolve `host` with the system resolver (numeric spellings such as `0x7f.1` included)."""
    import asyncio

    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in seen:
            seen.append(address)
    return seen


def parse_video_allowlist(value: str | None) -> tuple[Path, ...]:
    """The directories of `MLXCEL_VIDEO_DIR_ALLOWLIST` (comma-separated, absolute, existing).

    Fail-closed: an unset or empty value allows no local video; an entry that is relative or
    is not an existing directory is left out (with a warning), never widened to anything.
    """
    if not value:
        return ()
    dirs: list[Path] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        path = Path(entry)
        if not path.is_absolute():
            log.warning("%s: %r is not an absolute path; ignored", VIDEO_ALLOWLIST_ENV, entry)
            continue
        real = Path(os.path.realpath(path))
        if not real.is_dir():
            log.warning("%s: %r is not an existing directory; ignored", VIDEO_ALLOWLIST_ENV, entry)
            continue
        if real not in dirs:
            dirs.append(real)
    return tuple(dirs)


@dataclass(frozen=True)
class MediaPolicy:
    """What media a request may name, and the caps on fetching and decoding it."""

    media_root: Path | None = None
    """`--media-path`: local images/audio are read only under it (None: no local files)."""
    allow_private_urls: bool = False
    """`MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1`: lifts only the non-public-address rule."""
    video_dirs: tuple[Path, ...] = ()
    """`MLXCEL_VIDEO_DIR_ALLOWLIST`, read once at start: local video only under these."""
    max_image_bytes: int = 20 * MiB
    max_audio_bytes: int = 25 * MiB
    max_video_bytes: int = 200 * MiB
    max_image_pixels: int = 50_000_000
    timeout_s: float = 30.0
    max_redirects: int = 5
    is_public: AddressPredicate = is_public_address
    resolver: Resolver = field(default=system_resolver)

    @classmethod
    def from_environment(
        cls, media_path: str | None, environ: Mapping[str, str] | None = None
    ) -> MediaPolicy:
        """The policy for a server started with `--media-path` and the process environment."""
        env = os.environ if environ is None else environ
        root = Path(os.path.realpath(media_path)) if media_path else None
        return cls(
            media_root=root,
            allow_private_urls=env.get(ALLOW_PRIVATE_ENV) == "1",
            video_dirs=parse_video_allowlist(env.get(VIDEO_ALLOWLIST_ENV)),
        )

    def max_bytes(self, kind: str) -> int:
        """The size cap for one media item of `kind` (image, audio, video)."""
        return {
            "image": self.max_image_bytes,
            "audio": self.max_audio_bytes,
            "video": self.max_video_bytes,
        }[kind]
