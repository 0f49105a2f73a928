"""One vision request's model inputs once the processor ran, and its prompt-cache key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEDIA_TOKEN_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "audio_token_id")
"""The config fields naming a model's media placeholder tokens (mlx-vlm's configs)."""


@dataclass
class PreparedPrompt:
    """Model inputs of one request: expanded token ids and the processor's tensors.

    `cache_key` is `tokens` with every media placeholder replaced by a negative id drawn
    from the media's content digest: equal media give equal keys, other media (of the same
    size) part from the first placeholder on, and no key collides with a text token."""

    tokens: list[int]
    input_ids: Any
    pixel_values: Any
    mask: Any
    extra: dict[str, Any]
    digest: str
    cache_key: list[int]

    @property
    def has_media(self) -> bool:
        return self.cache_key != self.tokens

    @property
    def media_end(self) -> int:
        """The index after the prompt's last media placeholder (0 without media)."""
        for i in range(len(self.tokens) - 1, -1, -1):
            if self.cache_key[i] != self.tokens[i]:
                return i + 1
        return 0


def media_token_ids(config: Any) -> frozenset[int]:
    """The ids of a model's media placeholder tokens, from its config."""
    ids: set[int] = set()
    for name in MEDIA_TOKEN_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int):
            ids.add(value)
    return frozenset(ids)


def media_cache_key(tokens: list[int], media_tokens: frozenset[int], digest: str) -> list[int]:
    """`tokens` with each media placeholder replaced by the digest's negative id."""
    if not any(t in media_tokens for t in tokens):
        return list(tokens)
    salt = -1 - int(digest[:15], 16)
    return [salt if t in media_tokens else t for t in tokens]
