"""Staging media bytes as a private file for decoders that need a path (ffmpeg, video readers)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_file(data: bytes | Iterable[bytes], suffix: str = ".bin") -> Iterator[Path]:
    """A fresh 0600 file holding `data` (bytes, or pieces of bytes written in turn) inside a
    fresh 0700 directory, removed afterwards."""
    directory = tempfile.mkdtemp(prefix="mlxcel-media-")
    try:
        os.chmod(directory, 0o700)
        path = os.path.join(directory, "media" + suffix)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            for piece in [data] if isinstance(data, bytes) else data:
                view = memoryview(piece)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
        finally:
            os.close(fd)
        yield Path(path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
