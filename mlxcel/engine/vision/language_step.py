"""A vision-language model's language model as the engine's batched step runs a model.

`DecodeBatch` (over mlx-lm's batch classes) calls `model(tokens[B, L], cache=...)` and
wants logits; mlx-vlm's language models return a `LanguageModelOutput` and, in the mRoPE
families (Qwen2-VL and its kin), place positions by the sequence's media: after an image
a row's position is its cache offset plus a per-sequence delta. `LanguageStep` gives the
language model that face, the delta of each row from `before_forward(uids)`.

`prefill_media` runs one request's multimodal prefill (the media through the vision tower,
merged into the prompt's embeddings, every prompt token but the last through the language
model, in chunks) into a KV cache, which then joins the decoding batch like a prompt-cache
hit; the last prompt token goes through the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from mlxcel.engine.vision.prepared import PreparedPrompt


class LanguageStep:
    """The language model of an mlx-vlm model: tokens and a KV cache in, logits out."""

    def __init__(self, model: Any) -> None:
        self.vlm = model
        self.language_model = model.language_model
        self.mrope = hasattr(self.language_model, "get_rope_index")
        self._rows: list[int] = []
        self._deltas: dict[int, int] = {}  # rows whose positions are shifted by their media

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def make_cache(self) -> list[Any]:
        """A fresh per-sequence KV cache, the language model's own kind per layer."""
        from mlx_vlm.models.cache import KVCache

        make = getattr(self.language_model, "make_cache", None)
        if make is not None:
            return list(make())
        return [KVCache() for _ in self.language_model.layers]

    def place(self, uid: int, delta: int) -> None:
        """Row `uid`'s positions are its cache offset plus `delta` (mRoPE after media)."""
        if delta:
            self._deltas[uid] = delta

    def forget(self, uid: int) -> None:
        self._deltas.pop(uid, None)

    def before_forward(self, uids: list[int]) -> None:
        """The rows of the next forward, in order."""
        self._rows = uids

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if not self.mrope:
            return self.language_model(inputs, cache=cache).logits
        b, n = inputs.shape
        offset = cache[0].offset
        offsets = offset.reshape(-1) if isinstance(offset, mx.array) else mx.array([offset])
        offsets = mx.broadcast_to(mx.maximum(offsets, 0), (b,))
        if self._deltas and len(self._rows) == b:
            offsets = offsets + mx.array([self._deltas.get(uid, 0) for uid in self._rows])
        positions = mx.arange(n)[None, :] + offsets[:, None]
        positions = mx.broadcast_to(positions[None], (3, b, n))
        return self.language_model(inputs, cache=cache, position_ids=positions).logits


def prefill_media(
    step: LanguageStep,
    prepared: PreparedPrompt,
    cache: list[Any] | None,
    start: int,
    chunk: int,
) -> tuple[list[Any], int]:
    """Run the prompt's tokens `start..len-1` (all but the last) through the language model
    on top of `cache` (holding the first `start`; a fresh one when None), their embeddings
    carrying the media. Returns the cache and the row's position delta."""
    model = step.vlm
    ids = prepared.input_ids
    features = model.get_input_embeddings(
        ids, prepared.pixel_values, mask=prepared.mask, **prepared.extra
    )
    kwargs = {k: v for k, v in features.to_dict().items() if k != "inputs_embeds" and v is not None}
    embeds = features.inputs_embeds
    if cache is None:
        cache = step.make_cache()
    end = ids.shape[1] - 1
    position = start
    while position < end:
        n = min(chunk, end - position)
        step.language_model(
            inputs=ids[:, position : position + n],
            inputs_embeds=embeds[:, position : position + n],
            cache=cache,
            n_to_process=n,
            logits_to_keep=1,
            **kwargs,
        )
        mx.eval([c.state for c in cache])
        position += n
    return cache, _delta(kwargs.get("rope_deltas"))


def _delta(rope_deltas: Any) -> int:
    if rope_deltas is None:
        return 0
    values: Sequence[int] = rope_deltas.reshape(-1).tolist()
    return int(values[0])
