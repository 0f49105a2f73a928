"""Tokenize embedding and rerank inputs, with truncation to the model's limit (or an error)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import ContextLengthError, InvalidRequestError, ModelLoadError

EmbeddingInput = str | Sequence[int] | Sequence[int | str]
"""One input: a text, token ids used as given, or a mix of both (llama-server's mixed
prompts: each text piece becomes its tokens, without special tokens, in place)."""


@dataclass(frozen=True)
class TokenizedInput:
    """Token ids of one input (or one query/document pair) ready for the model."""

    ids: tuple[int, ...]
    type_ids: tuple[int, ...] | None = None
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.ids)


def too_long(index: int, count: int, limit: int, what: str = "input") -> ContextLengthError:
    """The error for an input over the limit when truncation is off."""
    return ContextLengthError(
        f"{what} {index} has {count} tokens, more than the model's limit of {limit}: "
        "too large to process; shorten it or allow truncation",
        n_prompt_tokens=count,
        n_ctx=limit,
    )


class TextTokenizer:
    """A Rust `tokenizers` tokenizer owned by one model (padding and truncation off)."""

    def __init__(self, backend: Any) -> None:
        from tokenizers import Tokenizer

        # A private copy: truncation settings are state, and the backend may be shared.
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.no_padding()
        self._tok.no_truncation()
        self._lock = threading.Lock()
        self.vocab_size: int = int(self._tok.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_dir(cls, path: Path) -> TextTokenizer:
        """The tokenizer of a Hugging Face directory (`tokenizer.json`, else transformers)."""
        file = path / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer

            try:
                return cls(Tokenizer.from_file(str(file)))
            except Exception as exc:  # tokenizers raises a bare Exception on bad files
                raise ModelLoadError(f"{path.name}: cannot read tokenizer.json ({exc})") from exc
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path.name}: no usable tokenizer ({exc})") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ModelLoadError(f"{path.name}: the tokenizer has no fast (Rust) backend")
        return cls(backend)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary token, or None."""
        value = self._tok.token_to_id(token)
        return None if value is None else int(value)

    def count(self, text: str | tuple[str, str]) -> int:
        """Tokens of `text` (or a pair) with special tokens, without truncation."""
        with self._lock:
            self._tok.no_truncation()
            return len(
                self._tok.encode(*text) if isinstance(text, tuple) else self._tok.encode(text)
            )

    def encode(
        self, inputs: Sequence[EmbeddingInput], *, max_length: int, truncate: bool
    ) -> list[TokenizedInput]:
        """Tokenize texts (token-id lists pass through, checked) to at most `max_length` tokens.

        An empty text is the model's special tokens alone (llama-server embeds it too).
        """
        texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
        out: list[TokenizedInput | None] = [None] * len(inputs)
        for i, x in enumerate(inputs):
            if not isinstance(x, str):
                out[i] = self._ids_input(i, self._expand(x), max_length, truncate)
        if texts:
            encodings = self._encode_batch([t for _, t in texts], max_length)
            for (i, text), enc in zip(texts, encodings, strict=True):
                truncated = bool(enc.overflowing)
                if truncated and not truncate:
                    raise too_long(i, self.count(text), max_length)
                if not enc.ids:
                    raise InvalidRequestError(f"input {i} has no tokens")
                out[i] = TokenizedInput(tuple(enc.ids), tuple(enc.type_ids), truncated)
        return [t for t in out if t is not None]

    def encode_pairs(
        self, query: str, documents: Sequence[str], *, max_length: int, truncate: bool
    ) -> list[TokenizedInput]:
        """Tokenize (query, document) pairs for a cross-encoder, to at most `max_length`."""
        pairs = [(query, doc) for doc in documents]
        encodings = self._encode_batch(pairs, max_length)
        out = []
        for i, (pair, enc) in enumerate(zip(pairs, encodings, strict=True)):
            truncated = bool(enc.overflowing)
            if truncated and not truncate:
                raise too_long(i, self.count(pair), max_length, what="query + document")
            out.append(TokenizedInput(tuple(enc.ids), tuple(enc.type_ids), truncated))
        return out

    def plain_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with no special tokens and no truncation."""
        with self._lock:
            self._tok.no_truncation()
            encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def _encode_batch(self, items: list[Any], max_length: int) -> list[Any]:
        with self._lock:
            self._tok.enable_truncation(max_length)
            try:
                return list(self._tok.encode_batch(items))
            finally:
                self._tok.no_truncation()

    def _expand(self, pieces: Sequence[int | str]) -> list[int]:
        """Token ids of a mixed prompt: ids as given, texts tokenized without special tokens."""
        texts = [p for p in pieces if isinstance(p, str)]
        if not texts:
            return list(pieces)  # type: ignore[arg-type]
        tokenized = iter(self.plain_ids(texts))
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, str):
                ids.extend(next(tokenized))
            else:
                ids.append(piece)
        return ids

    def _ids_input(
        self, index: int, ids: Sequence[int], max_length: int, truncate: bool
    ) -> TokenizedInput:
        values = list(ids)
        if not values:
            raise InvalidRequestError(f"input {index} is empty")
        for token in values:
            if isinstance(token, bool) or not isinstance(token, int):
                raise InvalidRequestError(f"input {index}: token ids must be integers")
            if not 0 <= token < self.vocab_size:
                raise InvalidRequestError(
                    f"input {index}: token id {token} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )
        if len(values) > max_length:
            if not truncate:
                raise too_long(index, len(values), max_length)
            return TokenizedInput(tuple(values[:max_length]), None, True)
        return TokenizedInput(tuple(values), None, False)
