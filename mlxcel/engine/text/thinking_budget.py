"""Thinking budget: close a reasoning block after N generated tokens.

`ThinkingBudget` describes the limit for one request (the reasoning markup and whether the
prompt already opened a block); `processor(tokenizer)` builds the per-sequence logits
processor. It follows the generated tokens: inside a reasoning block it counts them, and
once the count reaches the budget it forces the close tag, token by token, after which the
model answers normally. A budget of 0 closes the block before any reasoning token. Outside
reasoning it does nothing but note new tokens, and once the block has closed it returns the
logits untouched without reading the tokens (no host sync on the hot path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` reasoning tokens between `open_tag` and `close_tag`."""

    tokens: int
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    start_in_reasoning: bool = False

    def processor(self, tokenizer: Any) -> ThinkingBudgetProcessor:
        """A fresh logits processor for one sequence."""
        return ThinkingBudgetProcessor(
            self.tokens,
            open_ids=tuple(tokenizer.encode(self.open_tag, add_special=False)),
            close_ids=tuple(tokenizer.encode(self.close_tag, add_special=False)),
            start_in_reasoning=self.start_in_reasoning,
        )


class ThinkingBudgetProcessor:
    """mlx-lm logits processor `(tokens, logits) -> logits` enforcing one budget."""

    def __init__(
        self,
        budget: int,
        *,
        open_ids: tuple[int, ...],
        close_ids: tuple[int, ...],
        start_in_reasoning: bool,
    ) -> None:
        self.budget = max(0, budget)
        self.open_ids = open_ids
        self.close_ids = close_ids
        self.inside = start_in_reasoning
        self.done = not close_ids
        self.count = 0  # reasoning tokens generated in the open block
        self.forcing = False  # the close tag is being forced
        self.forced = 0  # close-tag tokens forced so far
        self._recent: list[int] = []
        self._seen: int | None = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if self.done:
            return logits
        n = int(tokens.size)
        if self._seen is None:  # the first call sees the prompt only
            self._seen = n
        elif n > self._seen:
            new: list[int] = tokens[self._seen : n].tolist()
            self._seen = n
            for token in new:
                self._advance(int(token))
            if self.done:
                return logits
        if self.inside and not self.forcing and self.count >= self.budget:
            self.forcing = True
        if self.forcing:
            return _only(logits, self.close_ids[self.forced])
        return logits

    def _advance(self, token: int) -> None:
        if self.forcing:  # the token forced at the previous step
            self.forced += 1
            self.done = self.forced >= len(self.close_ids)
            return
        self._recent.append(token)
        if len(self._recent) > max(len(self.open_ids), len(self.close_ids)):
            del self._recent[0]
        if not self.inside:
            if self.open_ids and tuple(self._recent[-len(self.open_ids) :]) == self.open_ids:
                self.inside = True
                self.count = 0
            return
        if tuple(self._recent[-len(self.close_ids) :]) == self.close_ids:
            self.done = True  # the model closed the block itself
            return
        self.count += 1


def _only(logits: Any, token: int) -> Any:
    """`logits` with every column but `token` at -inf."""
    import mlx.core as mx

    column = mx.arange(logits.shape[-1]) == token
    only = mx.where(column, mx.array(0.0, dtype=logits.dtype), mx.array(-mx.inf, logits.dtype))
    return mx.broadcast_to(only, logits.shape)
