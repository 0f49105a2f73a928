"""Prompt lookup: draft the tokens that followed the last earlier occurrence of the suffix.

An index maps every n-gram of the sequence (prompt and output so far, n between `ngram_min`
and `ngram_max`) to where its most recent occurrence that has a continuation ends. A draft
takes the longest n-gram ending the sequence that occurred before and copies what followed
it. When the copy runs into the end of the sequence it continues with the draft itself, so a
repeating pattern keeps drafting. Pure Python; the index grows by a few dict writes per token.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """The n-gram index of one sequence, extended as the sequence grows."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        # _index[n][ngram] = position right after the most recent occurrence that is
        # followed by at least one token (the suffix itself is never in the index).
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(ngram_min, ngram_max + 1)
        }
        self._indexed = 0  # tokens that have been followed by a token and indexed

    def extend(self, tokens: Sequence[int]) -> None:
        """Index `tokens` (the whole sequence so far; it only ever grows at the end)."""
        end = len(tokens)
        if end < self._indexed:
            raise ValueError("the sequence shrank; a lookup index only grows")
        for pos in range(max(self._indexed, 1), end):  # n-grams ending right before `pos`
            for n, index in self._index.items():
                if pos >= n:
                    index[tuple(tokens[pos - n : pos])] = pos
        self._indexed = max(self._indexed, end)

    def propose(self, tokens: Sequence[int], n_max: int) -> list[int]:
        """Up to `n_max` drafted tokens to follow `tokens` ([] when no n-gram matches)."""
        self.extend(tokens)
        length = len(tokens)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            start = self._index[n].get(tuple(tokens[length - n :]))
            if start is None:
                continue
            draft: list[int] = []
            for k in range(n_max):
                at = start + k
                draft.append(tokens[at] if at < length else draft[at - length])
            return draft
        return []
