"""Which inputs a checkpoint takes, read from its config.json."""

from __future__ import annotations

from typing import Any

NATIVE_VIDEO_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})
"""Families whose processor consumes a clip directly (the others get sampled frames)."""

VIDEO_WITH_AUDIO_FAMILIES = frozenset({"gemma4_unified"})
"""The only families the spec lets take video and audio in one request."""

_AUDIO_KEYS = ("audio_config", "audio_encoder_config")


def vision_modalities(config: dict[str, Any]) -> frozenset[str]:
    """The input kinds ("text", "image", "video", "audio") a model config declares."""
    kinds = {"text"}
    if isinstance(config.get("vision_config"), dict):
        kinds.update({"image", "video"})  # video: natively or as sampled frames
    if any(isinstance(config.get(key), dict) for key in _AUDIO_KEYS):
        kinds.add("audio")
    return frozenset(kinds)


def is_vision_config(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a model that takes more than text."""
    return vision_modalities(config) != {"text"}
