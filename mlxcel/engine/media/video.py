"""Sampling frames of a video with ffmpeg, from a file staged here (never a path a user named).

ffmpeg reads only that file, with the demuxer of its sniffed container (`ffmpeg_input`): a
playlist, manifest or any container outside the allowlist is refused before ffmpeg runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from mlxcel.engine.ffmpeg_input import VIDEO_CONTAINERS, find_ffmpeg, input_args, sniff_container
from mlxcel.engine.media.errors import MediaError
from mlxcel.engine.media.images import decode_image
from mlxcel.engine.media.staging import staged_file

_MAX_EXTRACTED = 2000


def ffmpeg_path() -> str | None:
    """The ffmpeg on PATH, if any."""
    return find_ffmpeg()


def sample_frames(
    data: bytes, *, max_frames: int, fps: float, max_pixels: int, timeout_s: float = 60.0
) -> list[Any]:
    """Up to `max_frames` evenly spaced RGB frames (PIL) of the clip in `data` (mp4/mov,
    webm/mkv, avi or MPEG-TS; MediaError for anything else)."""
    container = sniff_container(data)
    if container is None or container not in VIDEO_CONTAINERS:
        raise MediaError(
            "unsupported video container: send mp4/mov, webm/mkv, avi or MPEG-TS bytes "
            "(playlists and manifests are refused)"
        )
    ffmpeg = ffmpeg_path()
    if ffmpeg is None:
        raise MediaError("video inputs need ffmpeg on the server's PATH")
    with staged_file(data, ".video") as clip:
        out_dir = clip.parent / "frames"
        out_dir.mkdir(mode=0o700)
        command = [
            ffmpeg,
            "-nostdin",
            "-v",
            "error",
            *input_args(container, str(clip)),
            "-vf",
            f"fps={fps:g}",
            "-frames:v",
            str(_MAX_EXTRACTED),
            str(out_dir / "f%05d.png"),
        ]
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MediaError(f"video decoding took longer than {timeout_s:g} s") from None
        except subprocess.CalledProcessError:
            raise MediaError("video data could not be decoded") from None
        files = sorted(out_dir.glob("f*.png"))
        if not files:
            raise MediaError("video has no frames")
        picks = _evenly(len(files), max_frames)
        return [decode_image(Path(files[i]).read_bytes(), max_pixels) for i in picks]


def _evenly(n: int, k: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return [round(i * (n - 1) / (k - 1)) for i in range(k)] if k > 1 else [0]
