"""The solo lane: one sequence decoding outside the batch generator, in verify rounds.

The engine moves a sequence here while it is the only one holding a slot (see
`TextEngine`): it takes the sequence out of mlx-lm's `BatchGenerator` with its KV cache,
then each round drafts k tokens (k = 0: a plain step), runs one target forward over
`[last token, drafts...]`, keeps the longest drafted prefix the target's own choice agrees
with, adds the target's next token, and trims the rejected drafts off the cache. The tokens
come out with their log-probability rows, as the generator's would, and the engine sends
them through its usual per-token path. When the lane ends the sequence goes back into the
generator with its cache and the tokens it holds.

Invariant: the cache holds `history[:-1]`; `history[-1]` is the last token emitted (or, right
after the lane took the sequence over, the token the generator had already chosen, which the
first round emits).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.speculative.config import SpeculationConfig
from mlxcel.engine.text.speculative.drafters import Drafter, DraftModelDrafter, LookupDrafter
from mlxcel.engine.text.speculative.policy import DraftPolicy, RoundCosts

if TYPE_CHECKING:
    from mlxcel.engine.loading.model import LoadedModel

log = logging.getLogger(__name__)

DRY_COOLDOWN = 16  # generator tokens before a sequence whose drafts all failed may come back
DRY_COOLDOWN_MAX = 512


@dataclass
class LaneToken:
    """A token the lane emits, shaped like a `BatchGenerator` response for the engine."""

    token: int
    logprobs: Any
    finish_reason: str | None = None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None


@dataclass
class SequenceSpeculation:
    """One request's drafter, policy and counters, kept across its lane visits."""

    drafter: Drafter
    policy: DraftPolicy
    kind: str
    draft_n: int = 0  # tokens drafted and verified
    draft_n_accepted: int = 0
    draft_rounds: int = 0
    history: list[int] = field(default_factory=list)  # prompt + emitted tokens (the engine's)
    enter_at: int = 1  # generated tokens the request needs before it may enter the lane
    cooldown: int = DRY_COOLDOWN
    accepted_this_visit: int = field(default=0, repr=False)


class SoloLane:
    """Verify rounds on one sequence's own KV cache."""

    def __init__(
        self,
        model: Any,
        cache: list[Any],
        history: list[int],
        sampler: Any,
        seq: SequenceSpeculation,
        pending: tuple[int, Any] | None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.history = history
        self.sampler = sampler
        self.seq = seq
        self._pending = pending
        self._planned: int | None = None
        self._rounds = 0
        seq.accepted_this_visit = 0

    def plan(self, budget: int) -> bool:
        """Whether the next round is worth running here: it emits the pending token, or the
        policy drafts k > 0 tokens (kept for `round`). False: plain steps belong in the
        batch generator, whose steps overlap graph building with evaluation."""
        if self._pending is not None:
            return True
        seq = self.seq
        self._planned = seq.policy.choose(seq.drafter.available(self.history), budget)
        return self._planned > 0

    def round(self, budget: int) -> list[tuple[int, Any]]:
        """One step; the tokens it yields (at most `budget`) with their log-probability rows.

        The rows are lazy `mx.array`s, the logits' log-softmax, as the generator gives them.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return [pending]
        import mlx.core as mx

        seq, history = self.seq, self.history
        k, self._planned = self._planned, None
        if k is None:
            k = seq.policy.choose(seq.drafter.available(history), budget)
        if k:
            seq.drafter.prepare(history)
        start = time.perf_counter()
        drafted: list[int] = []
        if k:
            drafts = seq.drafter.draft(history, k)
            if isinstance(drafts, list):
                drafted = drafts
                inputs = mx.array([[history[-1], *drafts]], dtype=mx.uint32)
            else:
                inputs = mx.concatenate([mx.array([history[-1]], dtype=mx.uint32), drafts])[None]
        else:
            inputs = mx.array([[history[-1]]], dtype=mx.uint32)
        logits = self.model(inputs, cache=self.cache)[0]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = self.sampler(logprobs)
        if k and not drafted:
            mx.eval(chosen, drafts)
            drafted = drafts.tolist()
        else:
            mx.eval(chosen)
        picks: list[int] = chosen.tolist()
        accepted = 0
        while accepted < k and drafted[accepted] == picks[accepted]:
            accepted += 1
        if accepted < k:
            for layer in self.cache:
                layer.trim(k - accepted)
        seq.policy.record(k, accepted, time.perf_counter() - start)
        if k:
            seq.draft_rounds += 1
            seq.draft_n += k
            seq.draft_n_accepted += accepted
            seq.accepted_this_visit += accepted
            self._rounds += 1
        emitted = picks[: accepted + 1]
        history.extend(emitted)
        return [(token, logprobs[i]) for i, token in enumerate(emitted)]

    def release(self) -> tuple[list[Any], list[int]]:
        """The KV cache and the tokens it holds (the lane is done with both)."""
        return self.cache, self.history[:-1]

    def hand_back(
        self,
        generator: Any,
        *,
        n_generated: int,
        max_tokens: int,
        sampler: Any,
        stop_sequences: Any,
    ) -> int:
        """Put the sequence back into `generator` (its next token follows the history);
        return its new uid. `n_generated`: the request's tokens so far, from which the
        next lane visit is scheduled (later after a visit that found nothing to draft)."""
        seq = self.seq
        n = n_generated
        if self._rounds and not seq.accepted_this_visit:
            seq.enter_at = n + seq.cooldown
            seq.cooldown = min(seq.cooldown * 2, DRY_COOLDOWN_MAX)
        else:
            seq.enter_at = n + 1
            if seq.accepted_this_visit:
                seq.cooldown = DRY_COOLDOWN
        (uid,) = generator.insert(
            [[self.history[-1]]],
            max_tokens=[max_tokens],
            caches=[self.cache],
            all_tokens=[self.history[:-1]],
            samplers=[sampler],
            logits_processors=[[]],
            stop_sequences=[stop_sequences],
        )
        return int(uid)


def _plain_kv_cache(cache: list[Any]) -> bool:
    from mlx_lm.models.cache import KVCache

    return bool(cache) and all(type(layer) is KVCache for layer in cache)


class Speculator:
    """A `TextEngine`'s speculation: its config, round costs, and lane entry."""

    def __init__(
        self, config: SpeculationConfig, target: LoadedModel, *, prefill_chunk: int = 512
    ) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.config = config
        self.kind = config.draft_kind
        self.model = target.model
        self.vocab = target.tokenizer.vocab_size
        self.prefill_chunk = prefill_chunk
        self.costs = RoundCosts()
        self.supported = _plain_kv_cache(make_prompt_cache(target.model))
        if not self.supported:
            log.warning(
                "speculative decoding is off: %s does not use a plain KV cache (sliding "
                "window or recurrent layers cannot be rewound)",
                target.info.name,
            )
        if config.draft is not None:
            from mlxcel.engine.errors import ModelLoadError
            from mlxcel.engine.text.speculative.config import check_draft_model

            check_draft_model(target, config.draft)
            if not _plain_kv_cache(make_prompt_cache(config.draft.model)):
                raise ModelLoadError(
                    f"draft model {config.draft.info.name}: its KV cache cannot be rewound "
                    "(sliding window or recurrent layers); pick a draft model without them"
                )

    def eligible(self, request: Any, processors: list[Any]) -> bool:
        """Whether `request` may use the lane: greedy, and no logits processor at all."""
        sampling = request.sampling
        greedy = sampling.temperature <= 0 or (sampling.top_k == 1 and not sampling.mirostat)
        return (
            self.supported
            and greedy
            and not processors
            and request.grammar is None
            and request.thinking is None
        )

    def sequence(self) -> SequenceSpeculation:
        """Fresh per-request state."""
        config = self.config
        drafter: Drafter
        if config.draft is not None:
            drafter = DraftModelDrafter(
                config.draft.model, config.n_max, self.prefill_chunk, self.vocab
            )
        else:
            drafter = LookupDrafter(config.n_max)
        policy = DraftPolicy(
            self.costs, n_max=config.n_max, n_min=config.n_min, adaptive=config.adaptive
        )
        return SequenceSpeculation(drafter=drafter, policy=policy, kind=self.kind)

    def wants_lane(self, seq: SequenceSpeculation, budget: int) -> bool:
        """Whether the policy would draft after the sequence's emitted tokens now."""
        return seq.policy.choose(seq.drafter.available(seq.history), budget) > 0

    def enter(
        self,
        generator: Any,
        uid: int,
        seq: SequenceSpeculation,
        sampler: Any,
        pending: tuple[Any, Any] | None = None,
    ) -> SoloLane:
        """Take sequence `uid` (decoding, one token emitted since it was inserted) out of
        `generator` into a lane.

        `pending`: the token (an `mx.array` scalar or an int) and log-probability row the
        generator already sampled for `uid` (it samples one step ahead), when the caller
        knows them; the lane's first round emits it. None: the lane trims that step off the
        cache and recomputes it (one more forward).
        """
        cache, tokens = generator.remove([uid], return_prompt_caches=True)[uid]
        history = list(tokens)
        if pending is None:  # recompute the step: the cache must not hold the last token
            for layer in cache:
                layer.trim(1)
        else:
            pending = (int(pending[0]), pending[1])
            history.append(pending[0])
        return SoloLane(self.model, list(cache), history, sampler, seq, pending)
