"""`VisionEngine`: the engine core over an mlx-vlm model, continuous batching included.

Everything but a step's inputs is `TextEngine`'s: the queue and priorities, admission and
memory checks, the engine thread, sleep/wake, the batched decode step (`DecodeBatch`) and
the token pipeline (detokenizer, stops, loop detection, logprobs, timings, progress,
counters). What differs is how a request's prompt gets into its KV cache and which model
runs the step:

- a request's media go through the model's processor (`prepare`: on the caller's worker
  thread when it prepares ahead, else on the engine thread at admission, never in
  `submit`), which expands the placeholders into the prompt's tokens;
- a request with media runs its multimodal prefill alone (`language_step.MediaPrefill`:
  the vision tower, then all prompt tokens but the last with the merged embeddings), a
  piece between two batch steps so the running requests go on decoding, then joins the
  decoding batch like a prompt-cache hit; a text-only request prefills in the batch as on
  a text model;
- the batch runs the model's language model (`language_step.LanguageStep`), which places
  each row's positions after its media (mRoPE), and hands a cross-attention model's rows
  their vision encoder's states (mllama: such a model gets one slot, so its requests run
  one after another).

The prompt cache works for media requests too, keyed by the prompt with each media
placeholder replaced by the media's content digest (`prepared.media_cache_key`), so a
follow-up turn about the same picture reuses its prefix; when the cached prefix holds
every media token, the vision tower does not run again and the rest prefills in the batch
as text (at the position delta those media gave the first time).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest
from mlxcel.engine.text.running_sequence import RunningSequence
from mlxcel.engine.text.scheduler import TextEngine
from mlxcel.engine.text.sleep import IdleSleep
from mlxcel.engine.text.submission import token_budget
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
from mlxcel.engine.vision.language_step import (
    LanguageStep,
    MediaPrefill,
    carries_encoder_states,
)
from mlxcel.engine.vision.loader import LoadedVisionModel
from mlxcel.engine.vision.prepared import PreparedPrompt, media_cache_key, media_token_ids

log = logging.getLogger(__name__)

MEDIA_DELTAS_KEPT = 1024
"""Media sets whose position delta is remembered, for follow-ups served by the cache."""


class VisionEngine(TextEngine[LoadedVisionModel]):
    """Continuous-batching generation over one mlx-vlm model (images, video, audio)."""

    def __init__(
        self,
        loaded: LoadedVisionModel,
        *,
        slots: int = 1,
        context_per_slot: int | None = None,
        kv_pool: int | None = None,
        prefill_chunk: int = 2048,
        max_queue_depth: int = 64,
        max_images: int = 16,
        prompt_cache: Any = None,
        batched_sampling: bool | None = None,
        sleep: IdleSleep | None = None,
    ) -> None:
        self.carries_states = carries_encoder_states(loaded.model)
        if self.carries_states and slots > 1:
            log.info(
                "%s reads its vision encoder's states at every step (cross-attention): "
                "one slot, requests run one after another",
                loaded.info.architecture,
            )
            slots = 1
        super().__init__(
            loaded,
            slots=slots,
            context_per_slot=context_per_slot,
            kv_pool=kv_pool,
            prefill_chunk=prefill_chunk,
            max_queue_depth=max_queue_depth,
            prompt_cache=prompt_cache,
            batched_sampling=batched_sampling,
            sleep=sleep,
        )
        self.max_images = max_images
        self._media_tokens = media_token_ids(getattr(loaded.model, "config", None))
        self._language: LanguageStep | None = None  # engine thread only
        # media digest -> the position delta of text after those media (engine thread only)
        self._media_deltas: OrderedDict[str, int] = OrderedDict()
        self._media_prefills: dict[str, MediaPrefill] = {}  # by request id (engine thread)
        self._carried: dict[str, dict[str, Any]] = {}  # a prefill's states until it joins
        self._prepare_lock = threading.Lock()

    @property
    def modalities(self) -> frozenset[str]:
        return self.loaded.modalities

    def check_media(self, inputs: VisionInputs) -> None:
        """Refuse media kinds this model does not take (InvalidRequestError, a 400)."""
        kinds = self.modalities
        if inputs.images and "image" not in kinds:
            raise InvalidRequestError("this model does not accept image inputs")
        if inputs.videos and "video" not in kinds:
            raise InvalidRequestError("this model does not accept video inputs")
        if inputs.audio and "audio" not in kinds:
            raise InvalidRequestError("this model does not accept audio inputs")
        if inputs.videos and inputs.audio and self.loaded.info.architecture != "gemma4_unified":
            raise InvalidRequestError("Combined video and audio inputs are not supported")
        if len(inputs.images) > self.max_images:
            raise InvalidRequestError(f"at most {self.max_images} images per request")

    def prepare(self, prompt: VisionPrompt) -> PreparedPrompt:
        """Run the model's processor on the prompt and media (placeholders expanded), once:
        the result is kept on `prompt`. Thread-safe; a server calls it on a worker thread
        before `submit`, since resizing a large picture takes seconds."""
        if isinstance(prompt.prepared, PreparedPrompt):
            return prompt.prepared
        from mlx_vlm import prepare_inputs

        self.check_media(prompt.inputs)
        inputs = prompt.inputs
        with self._prepare_lock:  # processors keep state; one call at a time
            try:
                out = prepare_inputs(
                    self.loaded.processor,
                    images=inputs.images or None,
                    audio=inputs.audio or None,
                    videos=inputs.videos or None,
                    prompts=[prompt.text],
                    add_special_tokens=False,
                    padding=False,
                )
            except (ValueError, TypeError, IndexError, KeyError) as exc:
                raise InvalidRequestError(f"the media could not be prepared: {exc}") from exc
            # Materialize here: a lazy graph built on this thread cannot be evaluated on the
            # engine thread (MLX streams are per thread).
            import mlx.core as mx

            mx.eval([v for v in out.values() if isinstance(v, mx.array)])
        input_ids = out["input_ids"]
        tokens = [int(t) for t in input_ids.reshape(-1).tolist()]
        extra = {
            k: v for k, v in out.items() if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        digest = inputs.digest()
        prompt.prepared = PreparedPrompt(
            tokens=tokens,
            input_ids=input_ids,
            pixel_values=out.get("pixel_values"),
            mask=out.get("attention_mask"),
            extra=extra,
            digest=digest,
            cache_key=media_cache_key(tokens, self._media_tokens, digest),
        )
        return prompt.prepared

    def check(self, request: GenerationRequest) -> int:
        """Validate `request` against the context; return its token budget."""
        return token_budget(request, self.context_per_slot)

    def submit(self, request: GenerationRequest, sink: Callable[[GenerationEvent], None]) -> None:
        """Queue `request` (its `media` a VisionPrompt, or None for text only). Media the
        caller did not prepare are prepared on the engine thread, not here: their checks
        then fail the request through its events."""
        media = request.media
        if media is None:
            media = request.media = VisionPrompt(self.tokenizer.decode(request.prompt_tokens))
        if not isinstance(media, VisionPrompt):
            raise InvalidRequestError("a vision request carries a VisionPrompt")
        if media.prepared is None and not media.inputs:
            self.prepare(media)  # text only: the processor tokenizes, nothing more
        if media.prepared is None:
            self.check_media(media.inputs)
            self._queue(request, sink, 0)
            self.start()
            return
        request.prompt_tokens = list(media.prepared.tokens)
        super().submit(request, sink)

    # ------------------------------------------------------------- engine thread

    def _admit(self, generator: Any, job: RunningSequence) -> None:
        media: VisionPrompt = job.request.media
        if media.prepared is None:  # not prepared ahead: the processor runs here
            request = job.request
            request.prompt_tokens = list(self.prepare(media).tokens)
            job.max_tokens = self.check(request)
            self.memory.admit(len(request.prompt_tokens), job.max_tokens, self.prefill_chunk)
        super()._admit(generator, job)

    def _step_model(self) -> tuple[Any, Callable[[list[int]], None] | None]:
        self._language = LanguageStep(self.loaded.model)
        return self._language, self._language.before_forward

    def _fall_asleep(self) -> None:
        self._language = None  # it holds the network
        super()._fall_asleep()

    def _start_cache(self, job: RunningSequence) -> list[Any] | None:
        prepared: PreparedPrompt = job.request.media.prepared
        if not prepared.has_media:
            return self._adopt(super()._start_cache(job))
        if job.max_tokens == 0:
            return None
        cache, start = None, 0
        if self._caching(job):
            cache, job.cache_n = self.prompt_cache.lookup(prepared.cache_key)
            cache = self._adopt(cache)
            start = job.cache_n
            delta = self._media_deltas.get(prepared.digest)
            covered = start >= prepared.media_end and not self.carries_states
            if cache is not None and covered and delta is not None:
                # Every media token is in the cached prefix: no vision tower, the rest is
                # text that prefills in the batch (a follow-up turn about the same media).
                job.start_n, job.position_delta = start, delta
                return cache
        assert self._language is not None
        self._media_prefills[job.request.request_id] = MediaPrefill(
            self._language, prepared, cache, start
        )
        job.start_n = start
        job.prefilling_alone = True
        return None

    def _grow_start_cache(self, job: RunningSequence) -> list[Any] | None:
        prefill = self._media_prefills[job.request.request_id]
        began, before = time.perf_counter(), prefill.position
        complete = prefill.advance(self.prefill_chunk)
        c = self.counters
        c.prefill_tokens_total += prefill.position - before
        c.prompt_seconds_total += time.perf_counter() - began
        c.prefill_chunks += int(prefill.position > before)
        if job.request.progress:
            self._pipeline.progress(job, prefill.position - job.start_n)
        if not complete:
            return None
        del self._media_prefills[job.request.request_id]
        if prefill.carried:
            self._carried[job.request.request_id] = prefill.carried
        self._remember_delta(prefill.prepared.digest, prefill.delta)
        job.start_n, job.position_delta = prefill.position, prefill.delta
        return prefill.cache

    def _store_prompt_cache(self, job: RunningSequence, tokens: Any, cache: Any) -> None:
        super()._store_prompt_cache(job, tokens, self._adopt(cache))

    def _adopt(self, cache: list[Any] | None) -> list[Any] | None:
        """A cache from outside the batch, its cross-attention layers as the step needs
        them (a cross-attention model only)."""
        if cache is None or not self.carries_states or self._language is None:
            return cache
        return self._language.adopt(cache)

    def _remember_delta(self, digest: str, delta: int) -> None:
        """Keep the position delta that text after these media takes (the latest
        `MEDIA_DELTAS_KEPT` media sets)."""
        self._media_deltas[digest] = delta
        self._media_deltas.move_to_end(digest)
        while len(self._media_deltas) > MEDIA_DELTAS_KEPT:
            self._media_deltas.popitem(last=False)

    def _inserted(self, job: RunningSequence) -> None:
        assert self._language is not None
        self._language.place(job.uid, job.position_delta)
        self._language.carry(job.uid, self._carried.pop(job.request.request_id, {}))

    def _cache_key(self, job: RunningSequence, tokens: list[int]) -> list[int]:
        prepared: PreparedPrompt = job.request.media.prepared
        n = len(prepared.tokens)
        if tokens[:n] != prepared.tokens:  # not this prompt's cache (cannot happen)
            return tokens
        return prepared.cache_key + tokens[n:]

    def _finish(self, job: RunningSequence, reason: Any, **fields: Any) -> None:
        self._media_prefills.pop(job.request.request_id, None)
        self._carried.pop(job.request.request_id, None)
        if self._language is not None and job.uid >= 0:
            self._language.forget(job.uid)
        super()._finish(job, reason, **fields)
