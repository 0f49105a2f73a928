"""The media access policy, built once when the server starts."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxcel.config import process_env
from mlxcel.engine.media.limits import MediaLimits
from mlxcel.server.media.addresses import AddressPredicate, is_public_address

log = logging.getLogger("mlxcel.media")

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> the addresses it resolves to, as text."""


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
    name = process_env.VIDEO_DIR_ALLOWLIST
    dirs: list[Path] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        path = Path(entry)
        if not path.is_absolute():
            log.warning("%s: %r is not an absolute path; ignored", name, entry)
            continue
        real = Path(os.path.realpath(path))
        if not real.is_dir():
            log.warning("%s: %r is not an existing directory; ignored", name, entry)
            continue
        if real not in dirs:
            dirs.append(real)
    return tuple(dirs)


@dataclass(frozen=True)
class MediaPolicy(MediaLimits):
    """What media a request may name, and the caps on fetching and decoding it."""

    media_root: Path | None = None
    """`--media-path`: local images/audio are read only under it (None: no local files)."""
    allow_private_urls: bool = False
    """`MLXCEL_ALLOW_PRIVATE_MEDIA_URLS=1`: lifts only the non-public-address rule."""
    video_dirs: tuple[Path, ...] = ()
    """`MLXCEL_VIDEO_DIR_ALLOWLIST`, read once at start: local video only under these."""
    timeout_s: float = 30.0
    max_redirects: int = 5
    is_public: AddressPredicate = is_public_address
    resolver: Resolver = field(default=system_resolver)

    @classmethod
    def from_environment(
        cls, media_path: str | None, environ: Mapping[str, str] | None = None
    ) -> MediaPolicy:
        """The policy for a server started with `--media-path` and the process environment."""
        root = Path(os.path.realpath(media_path)) if media_path else None
        return cls(
            media_root=root,
            allow_private_urls=process_env.allow_private_media_urls(environ),
            video_dirs=parse_video_allowlist(process_env.video_dir_allowlist(environ)),
        )
