"""`mlxcel generate --image/--video/--audio`: a vision model and the user's own media files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .common import fail

T = TypeVar("T")


def load_vision_or_exit(path: Path) -> Any:
    """Load the mlx-vlm model in `path`, or print one line and exit 2."""
    from rich.console import Console

    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.engine.vision.loader import load_vision_model

    console = Console(stderr=True)
    try:
        if not console.is_terminal:
            return load_vision_model(path, name=path.name)
        with console.status(f"loading {path.name}…"):
            return load_vision_model(path, name=path.name)
    except ModelLoadError as exc:
        fail(str(exc))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        fail(f"--{what} {path}: {exc.strerror or exc}")


def _decoded(path: str, what: str, decode: Callable[[bytes], T]) -> T:
    """The file's media as `decode` reads it; its MediaError names the file (of several)."""
    from mlxcel.engine.media import MediaError

    data = _read(path, what)
    try:
        return decode(data)
    except MediaError as exc:
        raise MediaError(f"--{what} {path}: {exc}") from exc


def vision_prompt(
    loaded: Any,
    text: str,
    *,
    system: str | None,
    images: list[str],
    videos: list[str],
    audio: list[str],
    video_max_frames: int,
) -> Any:
    """The rendered prompt with one placeholder per media item, and the decoded media.

    The files are the user's own, read directly (the server's access policy is for what
    requests name); decoding is the same as the server's (bounded pictures, WAV to 16 kHz,
    video frames by ffmpeg). Raises ValueError (MediaError, PromptError) on bad input.
    """
    from mlxcel.engine.media import (
        MediaError,
        MediaLimits,
        decode_image,
        decode_wav,
        sample_frames,
    )
    from mlxcel.engine.prompting import render_chat
    from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt

    limits = MediaLimits()
    inputs = VisionInputs()
    parts: list[dict[str, Any]] = []
    kinds = loaded.modalities
    for what, files in (("image", images), ("video", videos), ("audio", audio)):
        if files and what not in kinds:
            raise MediaError(f"{loaded.info.name} does not accept {what} inputs")
    if videos and audio and loaded.info.architecture != "gemma4_unified":
        raise MediaError("Combined video and audio inputs are not supported")
    for path in images:
        inputs.images.append(
            _decoded(path, "image", lambda data: decode_image(data, limits.max_image_pixels))
        )
        parts.append({"type": "image"})
    for path in videos:
        frames = _decoded(
            path,
            "video",
            lambda data: sample_frames(
                data, max_frames=video_max_frames, fps=2.0, max_pixels=limits.max_image_pixels
            ),
        )
        if loaded.native_video:
            inputs.videos.append(frames)
            parts.append({"type": "video"})
        else:
            inputs.images.extend(frames)
            parts.extend({"type": "image"} for _ in frames)
    for path in audio:
        inputs.audio.append(_decoded(path, "audio", decode_wav))
        parts.append({"type": "audio"})
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    content: str | list[dict[str, Any]] = (
        [*parts, {"type": "text", "text": text}] if parts else text
    )
    messages.append({"role": "user", "content": content})
    return VisionPrompt(render_chat(loaded.tokenizer, messages), inputs)
