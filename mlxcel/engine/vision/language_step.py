"""A vision-language model's language model as the engine's batched step runs a model.

`DecodeBatch` (over mlx-lm's batch classes) calls `model(tokens[B, L], cache=...)` and
wants logits; mlx-vlm's language models return a `LanguageModelOutput` and, in the mRoPE
families (Qwen2-VL and its kin), place positions by the sequence's media: after an image
a row's position is its cache offset plus a per-sequence delta. `LanguageStep` gives the
language model that face, the delta of each row from `before_forward(uids)`.

`MediaPrefill` runs one request's multimodal prefill (the media through the vision tower,
merged into the prompt's embeddings, every prompt token but the last through the language
model) into a KV cache a piece at a time, between the batch's steps; the cache then joins
the decoding batch like a prompt-cache hit, and the last prompt token goes through the
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxcel.engine.errors import InvalidRequestError

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


class MediaPrefill:
    """One request's multimodal prefill into its KV cache, a piece at a time: first the
    media through the vision tower (merged into the prompt's embeddings), then every prompt
    token but the last through the language model, `chunk` tokens a piece."""

    def __init__(
        self, step: LanguageStep, prepared: PreparedPrompt, cache: list[Any] | None, start: int
    ) -> None:
        self.step = step
        self.prepared = prepared
        self.cache = cache if cache is not None else step.make_cache()
        self.position = start  # prompt tokens in the cache
        self.end = len(prepared.tokens) - 1
        self.delta = 0  # the row's position delta after its media (mRoPE)
        self._embeds: mx.array | None = None
        self._kwargs: dict[str, Any] = {}

    def advance(self, chunk: int) -> bool:
        """Do the next piece; True once the cache holds all prompt tokens but the last."""
        prepared = self.prepared
        ids = prepared.input_ids
        if self._embeds is None:
            features = self.step.vlm.get_input_embeddings(
                ids, prepared.pixel_values, mask=prepared.mask, **prepared.extra
            )
            self._kwargs = {
                k: v
                for k, v in features.to_dict().items()
                if k != "inputs_embeds" and v is not None
            }
            self._embeds = features.inputs_embeds
            mx.eval(self._embeds)
            self.delta = _delta(self._kwargs.get("rope_deltas"))
            return self.position >= self.end
        n = min(chunk, self.end - self.position)
        if n > 0:
            at = self.position
            out = self.step.language_model(
                inputs=ids[:, at : at + n],
                inputs_embeds=self._embeds[:, at : at + n],
                cache=self.cache,
                n_to_process=n,
                logits_to_keep=1,
                **self._kwargs,
            )
            if not _decodes_alone(out):
                raise InvalidRequestError(
                    "this model's decoder reads its media encoder's states at every step "
                    "(cross-attention or encoder-decoder), which mlxcel's batched vision "
                    "engine does not carry: not supported"
                )
            mx.eval([c.state for c in self.cache])
            self.position += n
        return self.position >= self.end


def _decodes_alone(output: Any) -> bool:
    """Whether a language-model step needs nothing but its tokens and KV cache next time:
    mlx-vlm's cross-attention (mllama) and encoder-decoder (florence2) models hand their
    encoder's states to every decode step."""
    carried = ("cross_attention_states", "encoder_outputs")
    return all(getattr(output, name, None) is None for name in carried)


def _delta(rope_deltas: Any) -> int:
    if rope_deltas is None:
        return 0
    values: Sequence[int] = rope_deltas.reshape(-1).tolist()
    return int(values[0])
