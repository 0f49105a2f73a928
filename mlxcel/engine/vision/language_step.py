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

A cross-attention language model (mlx-vlm's mllama: Llama 3.2 Vision) reads its vision
encoder's states at every step, not only in the prefill. `MediaPrefill` keeps them
(`carried`), and `LanguageStep` hands each row's to every forward (`carry`); rows with
states of different sizes cannot share one forward, so such a model runs one sequence at a
time (`carries_encoder_states`: the engine gives it one slot). Encoder-decoder models
(florence2, nemotron_parse), whose prompt goes through an encoder rather than the KV
cache, are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mlxcel.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from mlxcel.engine.vision.prepared import PreparedPrompt


CARRIED = "cross_attention_states"
"""The language-model argument a cross-attention model reads at every step."""


def carries_encoder_states(model: Any) -> bool:
    """Whether `model`'s language model reads its vision encoder's states at every decode
    step (mllama's cross-attention layers): such a model decodes one sequence at a time."""
    try:
        parameters = inspect.signature(model.language_model.__call__).parameters
    except (TypeError, ValueError):
        return False
    return CARRIED in parameters


class LanguageStep:
    """The language model of an mlx-vlm model: tokens and a KV cache in, logits out."""

    def __init__(self, model: Any) -> None:
        self.vlm = model
        self.language_model = model.language_model
        self.mrope = hasattr(self.language_model, "get_rope_index")
        self._rows: list[int] = []
        self._deltas: dict[int, int] = {}  # rows whose positions are shifted by their media
        self._carried: dict[int, dict[str, mx.array]] = {}  # rows' encoder states

    @property
    def layers(self) -> Any:
        return self.language_model.layers

    def make_cache(self) -> list[Any]:
        """A fresh per-sequence KV cache, the language model's own kind per layer."""
        from mlx_vlm.models.cache import KVCache

        make = getattr(self.language_model, "make_cache", None)
        if make is not None:
            return list(make())
        return [
            _CrossAttentionCache() if hasattr(layer, "cross_attn") else KVCache()
            for layer in self.language_model.layers
        ]

    def adopt(self, cache: list[Any]) -> list[Any]:
        """`cache` with a cross-attention cache in each cross-attention layer: taking a
        sequence out of the batch, or reading it from the prompt cache's disk tier, gives
        mlx-lm's plain arrays cache there, which has no offset and cannot be trimmed."""
        return [
            c if isinstance(c, _CrossAttentionCache) or not hasattr(layer, "cross_attn")
            else _CrossAttentionCache()
            for layer, c in zip(self.language_model.layers, cache, strict=True)
        ]  # fmt: skip

    def place(self, uid: int, delta: int) -> None:
        """Row `uid`'s positions are its cache offset plus `delta` (mRoPE after media)."""
        if delta:
            self._deltas[uid] = delta

    def carry(self, uid: int, states: dict[str, mx.array]) -> None:
        """Row `uid`'s encoder states, handed to every forward of that row."""
        if states:
            self._carried[uid] = states

    def forget(self, uid: int) -> None:
        self._deltas.pop(uid, None)
        self._carried.pop(uid, None)

    def before_forward(self, uids: list[int]) -> None:
        """The rows of the next forward, in order."""
        self._rows = uids

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        if self._carried:
            if len(self._rows) != 1 or inputs.shape[0] != 1:
                raise RuntimeError("encoder states are carried for one row at a time")
            states = self._carried.get(self._rows[0], {})
            return self.language_model(inputs, cache=cache, **states).logits
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
        self.carried: dict[str, mx.array] = {}  # encoder states every step reads (mllama)
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
            states = self._kwargs.get(CARRIED)
            if states is not None:
                self.carried = {CARRIED: states}
            mx.eval(self._embeds, *self.carried.values())
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
            if getattr(out, "encoder_outputs", None) is not None:
                raise InvalidRequestError(
                    "this model is an encoder-decoder (its prompt goes through an encoder, "
                    "whose states its decoder reads at every step), which mlxcel's vision "
                    "engine does not run: not supported"
                )
            mx.eval([c.state for c in self.cache])
            self.position += n
        return self.position >= self.end


class _CrossAttentionCache(ArraysCache):
    """The cache of a cross-attention layer (mllama), which reads the carried encoder
    states and stores nothing: mlx-lm's arrays cache holding one placeholder value per
    sequence, at offset 0 (a KV cache with nothing in it cannot be merged into a batch or
    extracted from one)."""

    offset = 0

    def __init__(self, size: int = 1, left_padding: list[int] | None = None) -> None:
        super().__init__(size, left_padding)
        self[0] = mx.zeros((1, 1))

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return n  # nothing in it is per token


def _delta(rope_deltas: Any) -> int:
    if rope_deltas is None:
        return 0
    values: Sequence[int] = rope_deltas.reshape(-1).tolist()
    return int(values[0])
