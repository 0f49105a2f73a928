"""Fill-in-the-middle token ids of the served tokenizer, for POST /infill.

Reading them walks the whole vocabulary, so `FimTokens` (held by the server's state)
reads them at the first /infill and keeps them for that tokenizer.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer

# Fill-in-the-middle control tokens, by role, in the spellings model families use.
FIM_TOKENS: dict[str, tuple[str, ...]] = {
    "prefix": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<｜fim▁begin｜>", "[PREFIX]"),
    "suffix": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>", "<｜fim▁hole｜>", "[SUFFIX]"),
    "middle": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>", "<｜fim▁end｜>", "[MIDDLE]"),
    "file_sep": ("<|file_sep|>", "<file_sep>"),
}


def read_fim_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the FIM roles the vocabulary has (`prefix`, `suffix`, `middle`, `file_sep`)."""
    vocab = tokenizer.hf.get_vocab()
    found: dict[str, int] = {}
    for role, spellings in FIM_TOKENS.items():
        for spelling in spellings:
            if spelling in vocab:
                found[role] = int(vocab[spelling])
                break
    return found


class FimTokens:
    """The FIM token ids of one tokenizer, read at the first ask and kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None
        self._ids: dict[str, int] = {}

    def ids(self, tokenizer: Tokenizer) -> dict[str, int]:
        """`tokenizer`'s FIM ids by role (a copy); read again only for another tokenizer."""
        with self._lock:
            if self._tokenizer is not tokenizer:
                self._ids = read_fim_ids(tokenizer)
                self._tokenizer = tokenizer
            return dict(self._ids)
