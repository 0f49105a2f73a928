"""Media content parts → decoded inputs and template placeholders (all API families meet here)."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

from mlxcel.engine.media import video as video_module
from mlxcel.engine.media.audio import decode_wav
from mlxcel.server.media import MediaError, MediaPolicy
from mlxcel.server.media.parts import ModelMedia, collect_media, has_media

VISION = ModelMedia(frozenset({"text", "image", "video"}), native_video=False, video_max_frames=4)
NATIVE = ModelMedia(frozenset({"text", "image", "video"}), native_video=True, video_max_frames=3)
OMNI = ModelMedia(frozenset({"text", "image", "video", "audio"}), video_max_frames=2)
TEXT = ModelMedia(frozenset({"text"}))


def _png_uri(color: tuple[int, int, int] = (200, 0, 0), size: tuple[int, int] = (16, 12)) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _wav(rate: int = 8000, seconds: float = 0.5, channels: int = 1) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    tone = (np.sin(2 * np.pi * 440 * t) * 16000).astype("<i2")
    samples = np.repeat(tone[:, None], channels, axis=1).reshape(-1)
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if video_module.ffmpeg_path() is None:
        pytest.fail("ffmpeg is needed for the video tests (.ci/run installs it)")
    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i",
         "testsrc=size=64x48:rate=10:duration=2", "-pix_fmt", "yuv420p", str(path)],
        check=True,
    )  # fmt: skip
    return path.read_bytes()


def _collect(messages: list[dict], model: ModelMedia, policy: MediaPolicy | None = None):
    return asyncio.run(collect_media(messages, policy or MediaPolicy(), model))


def test_image_parts_become_placeholders_and_pictures() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": _png_uri((255, 0, 0))}},
                {"type": "image_url", "image_url": _png_uri((0, 0, 255), (8, 8))},
            ],
        },
    ]
    assert has_media(messages)
    out, inputs = _collect(messages, VISION)
    assert out[0] == messages[0]
    assert out[1]["content"] == [
        {"type": "text", "text": "compare"},
        {"type": "image"},
        {"type": "image"},
    ]
    assert [im.size for im in inputs.images] == [(16, 12), (8, 8)]
    assert inputs.images[0].getpixel((0, 0)) == (255, 0, 0)


def test_tool_result_images_are_collected_too() -> None:
    messages = [
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "image_url", "image_url": {"url": _png_uri()}}]},
    ]  # fmt: skip
    out, inputs = _collect(messages, VISION)
    assert out[0]["content"] == [{"type": "image"}] and len(inputs.images) == 1


def test_text_kinds_beside_media() -> None:
    """A refusal part reads as its text beside media as on a text-only model."""
    messages = [
        {"role": "assistant", "content": [
            {"type": "refusal", "refusal": "no"},
            {"type": "image_url", "image_url": {"url": _png_uri()}}]},
    ]  # fmt: skip
    out, _ = _collect(messages, VISION)
    assert out[0]["content"] == [{"type": "text", "text": "no"}, {"type": "image"}]


def test_text_only_models_refuse_media_parts() -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_uri()}}]}]
    with pytest.raises(MediaError, match="does not accept image"):
        _collect(image, TEXT)
    audio = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]  # fmt: skip
    with pytest.raises(MediaError, match="does not accept audio"):
        _collect(audio, VISION)
    assert not has_media([{"role": "user", "content": "hi"}])


def test_bad_image_data_is_a_clear_error() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    messages = [{"role": "user", "content": [part]}]
    with pytest.raises(MediaError, match="image"):
        _collect(messages, VISION)
    with pytest.raises(MediaError, match="url"):
        _collect([{"role": "user", "content": [{"type": "image_url"}]}], VISION)


def test_wav_decoding_resamples_to_16k_mono() -> None:
    mono = decode_wav(_wav(8000, 0.5))
    assert mono.dtype == np.float32 and len(mono) == 8000
    assert 0.3 < float(np.abs(mono).max()) <= 1.0
    stereo = decode_wav(_wav(16000, 0.25, channels=2))
    assert len(stereo) == 4000
    with pytest.raises(MediaError, match="WAV"):
        decode_wav(b"RIFF....not a wav")


def test_input_audio_parts(tmp_path: Path) -> None:
    data = base64.b64encode(_wav()).decode()
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
        {"type": "text", "text": "transcribe"}]}]  # fmt: skip
    out, inputs = _collect(messages, OMNI)
    assert out[0]["content"][0] == {"type": "audio"} and len(inputs.audio) == 1
    bad = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}}]}]  # fmt: skip
    with pytest.raises(MediaError, match="'wav'"):
        _collect(bad, OMNI)


def _video_message(clip: bytes, fps: object = 2.0) -> list[dict]:
    uri = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    return [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri, "fps": fps}}]}
    ]


def test_video_frame_fallback(clip: bytes) -> None:
    out, inputs = _collect(_video_message(clip), VISION)
    assert out[0]["content"] == [{"type": "image"}] * 4  # 2 s at 2 fps, capped at 4
    assert len(inputs.images) == 4 and inputs.images[0].size == (64, 48)
    assert inputs.images[0].tobytes() != inputs.images[-1].tobytes()  # the clip moves


def test_native_video_families_get_the_clip(clip: bytes) -> None:
    out, inputs = _collect(_video_message(clip, 5), NATIVE)
    assert out[0]["content"] == [{"type": "video"}]
    assert len(inputs.videos) == 1 and len(inputs.videos[0]) == 3 and not inputs.images


def test_video_fps_and_combined_audio_rules(clip: bytes) -> None:
    with pytest.raises(MediaError, match="fps"):
        _collect(_video_message(clip, 0), VISION)
    data = base64.b64encode(_wav()).decode()
    combined = _video_message(clip)
    combined[0]["content"].append({"type": "input_audio", "input_audio": {"data": data}})
    with pytest.raises(MediaError, match="Combined video and audio inputs are not supported"):
        _collect(combined, OMNI)


def test_video_without_ffmpeg_is_a_clear_error(
    clip: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(video_module, "ffmpeg_path", lambda: None)
    with pytest.raises(MediaError, match="ffmpeg"):
        _collect(_video_message(clip), VISION)


def test_undecodable_video(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="unsupported video container"):
        _collect(_video_message(b"\x00" * 1000), VISION)
    with pytest.raises(MediaError, match="decoded"):  # an mp4 header, then nothing usable
        _collect(_video_message(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 1000), VISION)
