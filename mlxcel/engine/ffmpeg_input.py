"""Handing bytes a client sent to ffmpeg so that it reads those bytes and nothing else.

ffmpeg left to itself probes the input's format, and some formats name other files or URLs:
an HLS playlist (`.m3u8`), a DASH manifest (`.mpd`), a concat script, an image2 pattern, a
QuickTime reference movie. A client's "video" could thus make the server read its own files or
reach its network. So the container is sniffed here from its magic bytes against an allowlist
(none of which can name another resource once the QuickTime references are kept off), the
matching demuxer is forced with `-f`, only that demuxer may open, and only the one protocol
the server itself uses (`file` for a staged file, `pipe` for standard input) may be opened.
"""

from __future__ import annotations

import shutil

_MPEGTS_PACKET = 188
_MPEGTS_PACKETS_CHECKED = 5
_QUICKTIME_ATOMS = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"})

DEMUXERS: dict[str, str] = {
    "mp4": "mov",  # mp4, mov, m4a, 3gp
    "webm": "matroska",  # webm and mkv (EBML)
    "avi": "avi",
    "mpegts": "mpegts",
    "wav": "wav",
    "flac": "flac",
    "ogg": "ogg",
    "mp3": "mp3",
    "aac": "aac",  # ADTS
    "aiff": "aiff",
}
"""The ffmpeg demuxer forced for each container `sniff_container` recognizes."""

VIDEO_CONTAINERS = frozenset({"mp4", "webm", "avi", "mpegts"})
"""Containers accepted as video."""

AUDIO_CONTAINERS = frozenset({"wav", "flac", "ogg", "mp3", "aac", "aiff", "mp4", "webm"})
"""Containers accepted as audio (OpenAI's list: flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav,
webm; plus raw AAC and AIFF)."""

# Demuxer-private options that keep a demuxer from opening anything but its input.
_CONFINED: dict[str, tuple[str, ...]] = {
    "mov": ("-enable_drefs", "0", "-use_absolute_path", "0"),
}


def find_ffmpeg() -> str | None:
    """The ffmpeg on PATH, if any."""
    return shutil.which("ffmpeg")


def _is_mpegts(data: bytes) -> bool:
    packets = min(len(data) // _MPEGTS_PACKET, _MPEGTS_PACKETS_CHECKED)
    return packets >= 1 and all(data[i * _MPEGTS_PACKET] == 0x47 for i in range(packets))


def _mpeg_audio_sync(head: bytes) -> str | None:
    """'aac' for an ADTS header, 'mp3' for an MPEG audio frame header, None otherwise."""
    if len(head) < 2 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return None
    if head[1] & 0xF6 == 0xF0:  # 12-bit sync 0xFFF and layer 00: ADTS
        return "aac"
    return "mp3" if head[1] & 0x06 else None  # layer 00 is reserved for MPEG audio


def sniff_container(data: bytes) -> str | None:
    """The container of `data` from its magic bytes (a key of `DEMUXERS`), or None."""
    head = data[:16]
    if head[:4] in (b"RIFF", b"RIFX"):
        return {b"WAVE": "wav", b"AVI ": "avi"}.get(data[8:12])
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[4:8] in _QUICKTIME_ATOMS:
        return "mp4"
    if head[:4] == b"FORM" and data[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head[:3] == b"ID3":
        return "mp3"
    if _is_mpegts(data):
        return "mpegts"
    return _mpeg_audio_sync(head)


def input_args(container: str, source: str) -> list[str]:
    """The ffmpeg arguments (ending with `-i source`) that open only `source` with the
    demuxer of `container`: `source` is `pipe:0` or the path of a file the server wrote."""
    demuxer = DEMUXERS[container]
    protocol = "pipe" if source.startswith("pipe:") else "file"
    url = source if protocol == "pipe" else f"file:{source}"
    return [
        "-protocol_whitelist",
        protocol,
        "-format_whitelist",
        demuxer,
        "-f",
        demuxer,
        *_CONFINED.get(demuxer, ()),
        "-i",
        url,
    ]
