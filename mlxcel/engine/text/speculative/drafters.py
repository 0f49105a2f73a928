"""Drafters: per-sequence sources of draft tokens (prompt lookup, a draft model).

A drafter sees the sequence's whole history (prompt and output; it only grows at the end)
and offers drafts for the tokens after it. `available` says how many it can offer now
(cheap); `prepare` does any slow catch-up before a round is timed; `draft` returns the
tokens, as a list or as a lazy `mx.array` that the verify forward evaluates with its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mlxcel.engine.text.speculative.lookup import PromptLookup


class Drafter(Protocol):
    """Drafts for one sequence."""

    def available(self, history: Sequence[int]) -> int:
        """How many tokens could be drafted after `history` now (0: none)."""
        ...

    def prepare(self, history: Sequence[int]) -> None:
        """Catch up with `history` before a timed round (may run the draft model)."""
        ...

    def draft(self, history: Sequence[int], k: int) -> Any:
        """`k` drafted tokens after `history`: a list of ids or a lazy 1-D `mx.array`."""
        ...


class LookupDrafter:
    """Prompt lookup drafts (see `PromptLookup`)."""

    def __init__(self, n_max: int, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.n_max = n_max
        self.lookup = PromptLookup(ngram_max, ngram_min)
        self._proposal: list[int] = []
        self._for_length = -1

    def available(self, history: Sequence[int]) -> int:
        self._proposal = self.lookup.propose(history, self.n_max)
        self._for_length = len(history)
        return len(self._proposal)

    def prepare(self, history: Sequence[int]) -> None:
        if self._for_length != len(history):
            self.available(history)

    def draft(self, history: Sequence[int], k: int) -> list[int]:
        self.prepare(history)
        return self._proposal[:k]


class DraftModelDrafter:
    """Greedy drafts from a small model with its own KV cache.

    The cache follows the sequence lazily: before drafting, the longest prefix it holds
    that is still part of the history is kept (rejected drafts are trimmed off) and the
    missing tokens are forwarded in chunks. Drafting then runs k one-token forwards whose
    results stay lazy until the verify forward evaluates them.
    """

    def __init__(
        self, model: Any, n_max: int, prefill_chunk: int = 512, vocab: int | None = None
    ) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.n_max = n_max
        self.vocab = vocab  # drafts stay below this id (the shared tokenizer's size)
        self.prefill_chunk = max(16, prefill_chunk)
        self.cache: list[Any] = make_prompt_cache(model)
        self._tokens: list[int] = []  # what the cache holds, up to `_lazy`
        self._lazy: Any = None  # drafted tokens forwarded into the cache, not yet read back
        self._verified = 0  # leading `_tokens` known to be part of the history

    def available(self, history: Sequence[int]) -> int:
        return self.n_max

    def _held(self) -> list[int]:
        if self._lazy is not None:
            self._tokens.extend(int(t) for t in self._lazy.tolist())
            self._lazy = None
        return self._tokens

    def prepare(self, history: Sequence[int]) -> None:
        import mlx.core as mx

        held = self._held()
        target = len(history) - 1  # the cache should hold all but the last token
        keep = min(self._verified, target)
        limit = min(len(held), target)
        while keep < limit and held[keep] == history[keep]:
            keep += 1
        if keep < len(held):
            for layer in self.cache:
                layer.trim(len(held) - keep)
            del held[keep:]
        while len(held) < target:
            chunk = list(history[len(held) : min(target, len(held) + self.prefill_chunk)])
            self.model(mx.array([chunk]), cache=self.cache)
            mx.eval([layer.state for layer in self.cache])
            held.extend(chunk)
        self._verified = len(held)

    def draft(self, history: Sequence[int], k: int) -> Any:
        import mlx.core as mx

        self.prepare(history)
        y = mx.array([history[-1]], dtype=mx.uint32)
        drafts = []
        for _ in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1:, : self.vocab]
            y = mx.argmax(logits, axis=-1).astype(mx.uint32)
            drafts.append(y)
        out = mx.concatenate(drafts) if drafts else mx.array([], dtype=mx.uint32)
        # The cache now holds the history and all drafts but the last.
        self._tokens.append(int(history[-1]))
        self._verified = len(self._tokens)
        self._lazy = out[: k - 1] if k > 1 else None
        return out
