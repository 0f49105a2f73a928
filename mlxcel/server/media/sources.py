"""One entry point for media a request names: data URI, http(s) URL, file:// URL or path."""

from __future__ import annotations

import base64
import binascii
import contextlib
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mlxcel.config import process_env
from mlxcel.config.process_env import media_processes
from mlxcel.engine.media.errors import MediaError
from mlxcel.engine.media.images import decode_image
from mlxcel.engine.media.staging import staged_file
from mlxcel.server.media.local import read_local_file
from mlxcel.server.media.offload import off_loop, off_process
from mlxcel.server.media.policy import MediaPolicy
from mlxcel.server.media.remote import fetch_url

MediaKind = Literal["image", "audio", "video"]


@dataclass(frozen=True)
class MediaBlob:
    """The bytes of one media item and where they came from."""

    kind: MediaKind
    data: bytes
    mime_type: str | None
    source: Literal["data", "url", "file"]


_B64_CHUNK = 1 << 18  # characters, a multiple of 4


def _b64decode(payload: str, what: str) -> bytes:
    """Strict base64 decoding in 256 KiB pieces: the decoder holds the GIL for its whole
    input, so a 20 MB payload in one call would stall the event loop for ~0.15 s even from a
    worker thread; between pieces the loop gets its turn."""
    pieces: list[bytes] = []
    try:
        for start in range(0, len(payload), _B64_CHUNK):
            piece = payload[start : start + _B64_CHUNK]
            if start + _B64_CHUNK < len(payload) and piece.endswith("="):
                raise ValueError("padding before the end")
            pieces.append(base64.b64decode(piece, validate=True))
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} data URI is not valid base64") from None
    return b"".join(pieces)


def parse_data_uri(uri: str, max_bytes: int, what: str) -> tuple[str | None, bytes]:
    """(media type, bytes) of a `data:` URI; the encoded size is checked before decoding."""
    header, sep, payload = uri[5:].partition(",")
    if not sep:
        raise MediaError(f"{what} data URI has no ',' before its data")
    parts = header.split(";")
    mime = parts[0].strip().lower() or None
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise MediaError(f"{what} is larger than {max_bytes} bytes")
    if "base64" in (p.strip().lower() for p in parts[1:]):
        data = _b64decode(payload, what)
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"{what} is larger than {max_bytes} bytes")
    return mime, data


def decode_image_uri(uri: str, max_bytes: int, max_pixels: int) -> Any:
    """The picture of an image data URI (base64 and picture decoding in one call, so a
    worker process sends back only the picture)."""
    _, data = parse_data_uri(uri, max_bytes, "image")
    return decode_image(data, max_pixels)


def decode_staged_image_uri(path: str, max_bytes: int, max_pixels: int) -> Any:
    """`decode_image_uri` of the data URI staged (UTF-8) in the file at `path`."""
    with open(path, "rb") as f:
        uri = f.read().decode("utf-8", "surrogatepass")
    return decode_image_uri(uri, max_bytes, max_pixels)


def is_data_uri(url: object) -> bool:
    return isinstance(url, str) and url[:5].lower() == "data:"


async def decode_data_image(uri: str, max_bytes: int, max_pixels: int) -> Any:
    """The picture of an image data URI, decoded in a media worker process (on the media
    threads where the processes are off). The URI reaches the worker as a private staged
    file, written on a media thread: sent through the pool's pipe, it took the server's GIL
    back for every 64 KiB written, which held up the event loop."""
    if not media_processes():
        return await off_loop(decode_image_uri, uri, max_bytes, max_pixels)
    with contextlib.ExitStack() as stack:
        path = await off_loop(_stage_text, stack, uri)
        try:
            return await off_process(decode_staged_image_uri, str(path), max_bytes, max_pixels)
        finally:
            await off_loop(stack.close)


def _stage_text(stack: contextlib.ExitStack, text: str) -> Path:
    """`text` (UTF-8) in a staged file, encoded a piece at a time (one copy of a whole data
    URI would hold the GIL for it)."""
    pieces = (
        text[at : at + _B64_CHUNK].encode("utf-8", "surrogatepass")
        for at in range(0, len(text), _B64_CHUNK)
    )
    return stack.enter_context(staged_file(pieces, ".uri"))


def _local_roots(kind: MediaKind, policy: MediaPolicy, what: str) -> tuple:
    if kind == "video":
        if not policy.video_dirs:
            raise MediaError(
                f"local {what} paths are disabled; list the allowed directories in "
                f"{process_env.VIDEO_DIR_ALLOWLIST} and restart the server"
            )
        return policy.video_dirs
    if policy.media_root is None:
        raise MediaError(f"local {what} paths are disabled; start the server with --media-path DIR")
    return (policy.media_root,)


async def load_media(url: str, kind: MediaKind, policy: MediaPolicy) -> MediaBlob:
    """The bytes `url` names, under `policy` (MediaError, a 400, when refused or unusable).

    Base64 decoding runs in a media worker process, file reads on the media threads
    (`offload`), fetches are async."""
    what = kind
    if not isinstance(url, str) or not url:
        raise MediaError(f"{what} url must be a non-empty string")
    max_bytes = policy.max_bytes(kind)
    lowered = url[:8].lower()
    if lowered.startswith("data:"):
        mime, data = await off_process(parse_data_uri, url, max_bytes, what)
        return MediaBlob(kind, data, mime, "data")
    if lowered.startswith(("http://", "https://")):
        data = await fetch_url(url, policy, max_bytes, what)
        return MediaBlob(kind, data, None, "url")
    if lowered.startswith("file:"):
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"{what} file:// URL must name a local path")
        path = urllib.parse.unquote(parsed.path)
    elif url.startswith("/"):
        path = url
    else:
        raise MediaError(
            f"{what} url must be a data URI, an http(s) URL, a file:// URL or an absolute path"
        )
    data = await off_loop(read_local_file, path, _local_roots(kind, policy, what), max_bytes, what)
    return MediaBlob(kind, data, None, "file")
