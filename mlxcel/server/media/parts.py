"""Media content parts of chat messages → decoded inputs plus template placeholders.

Every API family reaches the engine as OpenAI-style chat messages (Responses `input_image`
and Anthropic `image` blocks, tool results included, are converted to `image_url` parts before
this), so this one pass serves them all: each media part is fetched under the policy, decoded,
and replaced by the bare `{"type": "image"|"video"|"audio"}` part that chat templates place.
Fetching is async; decoding runs on the media pool (`offload`), never on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcel.engine.chat.messages import TEXT_PARTS
from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.media.audio import decode_wav
from mlxcel.engine.media.errors import MediaError
from mlxcel.engine.media.images import decode_image
from mlxcel.engine.media.video import sample_frames
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
from mlxcel.server.media.offload import off_loop, off_process
from mlxcel.server.media.policy import MediaPolicy
from mlxcel.server.media.sources import decode_data_image, is_data_uri, load_media

_KINDS = {
    "image_url": "image",
    "input_image": "image",
    "video_url": "video",
    "input_audio": "audio",
}


@dataclass(frozen=True)
class ModelMedia:
    """What the loaded model takes: its modalities, how it reads video, and its engine's
    processor (`prepare`, run off the event loop before submit; None: nothing to run)."""

    modalities: frozenset[str]
    native_video: bool = False
    video_with_audio: bool = False
    video_max_frames: int = 8
    prepare: Callable[[VisionPrompt], object] | None = None


def has_media(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any message has a media content part."""
    return any(
        isinstance(part, Mapping) and part.get("type") in _KINDS
        for message in messages
        if isinstance(message, Mapping) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


async def collect_media(
    messages: Sequence[Mapping[str, Any]], policy: MediaPolicy, model: ModelMedia
) -> tuple[list[dict[str, Any]], VisionInputs]:
    """(messages with placeholder parts, the decoded media) — MediaError (a 400) if refused."""
    inputs = VisionInputs()
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = _KINDS.get(str(part.get("type"))) if isinstance(part, Mapping) else None
            if kind is None:
                parts.append(_text_part(f"messages[{index}].content[{j}]", part))
                continue
            where = f"messages[{index}].content[{j}]"
            if kind not in model.modalities:
                raise MediaError(f"{where}: this model does not accept {kind} inputs")
            seen.add(kind)
            if {"video", "audio"} <= seen and not model.video_with_audio:
                raise MediaError("Combined video and audio inputs are not supported")
            parts.extend(await _load_part(where, kind, part, policy, model, inputs))
        out.append({**message, "content": parts})
    return out, inputs


async def _load_part(
    where: str,
    kind: str,
    part: Mapping[str, Any],
    policy: MediaPolicy,
    model: ModelMedia,
    inputs: VisionInputs,
) -> list[dict[str, Any]]:
    if kind == "image":
        url = _url(where, part.get("image_url"))
        if is_data_uri(url):  # one trip to a worker process: the picture comes back
            max_bytes = policy.max_bytes("image")
            image = await decode_data_image(url, max_bytes, policy.max_image_pixels)
        else:
            blob = await load_media(url, "image", policy)
            image = await off_process(decode_image, blob.data, policy.max_image_pixels)
        inputs.images.append(image)
        return [{"type": "image"}]
    if kind == "video":
        field = part.get("video_url")
        url = _url(where, field)
        fps = field.get("fps", 2.0) if isinstance(field, Mapping) else 2.0
        if not isinstance(fps, (int, float)) or not 0 < fps <= 60:
            raise MediaError(f"{where}: video_url.fps must be a number in (0, 60]")
        blob = await load_media(url, "video", policy)
        frames = await off_loop(
            sample_frames,
            blob.data,
            max_frames=model.video_max_frames,
            fps=float(fps),
            max_pixels=policy.max_image_pixels,
        )
        if model.native_video:
            inputs.videos.append(frames)
            return [{"type": "video"}]
        inputs.images.extend(frames)
        return [{"type": "image"} for _ in frames]
    audio = part.get("input_audio")
    if not isinstance(audio, Mapping) or not isinstance(audio.get("data"), str):
        raise MediaError(f"{where}: input_audio needs a 'data' string")
    fmt = audio.get("format", "wav")
    if fmt != "wav":
        raise MediaError(f"{where}: input_audio format must be 'wav'")
    data = audio["data"]
    url = data if data.startswith("data:") else f"data:audio/wav;base64,{data}"
    blob = await load_media(url, "audio", policy)
    inputs.audio.append(await off_loop(decode_wav, blob.data))
    return [{"type": "audio"}]


async def prepare_off_loop(model: ModelMedia, prompt: VisionPrompt) -> None:
    """Run the vision engine's processor (`model.prepare`) on `prompt` on the media pool
    (resizing and patching a large picture takes seconds); the engine keeps the result for
    its submit. MediaError (a 400) when the processor refuses the media."""
    if model.prepare is None or not prompt.inputs:
        return
    try:
        await off_loop(model.prepare, prompt)
    except InvalidRequestError as exc:
        raise MediaError(str(exc)) from None


def _url(where: str, value: Any) -> str:
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}: the media part needs a 'url' string")
    return url


def _text_part(where: str, part: Any) -> dict[str, Any]:
    """A text part as chat templates read it (`{"type": "text", "text": ...}`)."""
    if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise MediaError(f"{where}: '{kind}' content parts are not supported")
    key = TEXT_PARTS[part["type"]]
    text = part.get(key)
    if not isinstance(text, str):
        raise MediaError(f"{where}: a {part['type']} part needs a string '{key}'")
    return {"type": "text", "text": text}
