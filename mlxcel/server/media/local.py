"""Reading media from the local filesystem: only regular files under an allowed root."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mlxcel.engine.media.errors import MediaError


def _inside(path: str, root: Path) -> bool:
    root_text = str(root)
    return os.path.commonpath([path, root_text]) == root_text


def read_local_file(path_text: str, roots: tuple[Path, ...], max_bytes: int, what: str) -> bytes:
    """The bytes of the absolute path `path_text` if, symlinks resolved, it is a regular file
    under one of `roots` (already real paths) and at most `max_bytes` long."""
    if not os.path.isabs(path_text):
        raise MediaError(f"{what} path must be absolute")
    if "\x00" in path_text:
        raise MediaError(f"{what} path contains a NUL byte")
    real = os.path.realpath(path_text)
    if not any(_inside(real, root) for root in roots):
        raise MediaError(f"{what} path is outside the allowed media directories")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise MediaError(f"{what} file not found") from None
    except OSError as exc:
        raise MediaError(f"{what} file cannot be opened ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{what} path is not a regular file")
        if info.st_size > max_bytes:
            raise MediaError(f"{what} file is larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > max_bytes:
                raise MediaError(f"{what} file is larger than {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
