"""Incremental, UTF-8-safe detokenization."""

from __future__ import annotations

from collections.abc import Callable, Sequence

DecodeFn = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turn a growing token sequence into text deltas.

    Decodes only a short window of recent tokens per step (the prefix/read offset
    scheme), so the cost per token stays constant, and holds back output while the
    window ends inside an incomplete UTF-8 sequence (U+FFFD at the end).
    """

    __slots__ = ("_decode", "_tokens", "_prefix", "_read")

    def __init__(self, decode: DecodeFn, context: Sequence[int] = ()) -> None:
        # A few prompt tokens as context keep the first generated token's leading
        # space (SentencePiece decoders drop it at the start of a text).
        self._decode = decode
        self._tokens: list[int] = list(context)
        self._prefix = 0
        self._read = len(self._tokens)

    def add(self, token: int) -> str:
        """Append one token and return the newly decided text (possibly empty)."""
        tokens = self._tokens
        tokens.append(token)
        prefix_text = self._decode(tokens[self._prefix : self._read])
        full_text = self._decode(tokens[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(tokens)
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (a trailing partial character decodes lossy)."""
        tokens = self._tokens
        if self._read >= len(tokens):
            return ""
        prefix_text = self._decode(tokens[self._prefix : self._read])
        full_text = self._decode(tokens[self._prefix :])
        self._prefix = self._read = len(tokens)
        return full_text[len(prefix_text) :]
