"""The engine's tokenizer: one small interface over a Hugging Face fast tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mlxcel.engine.grammar.base import GrammarBackends
from mlxcel.engine.text.detokenizer import IncrementalDetokenizer

# How many prompt tokens seed a detokenizer, so the first generated token decodes in context.
_DETOKENIZER_CONTEXT = 4


_METASPACE = "\u2581"
"""SentencePiece's word-boundary mark, a space in decoded text."""


class Tokenizer:
    """Encode, decode, special tokens and streaming detokenizers for one model."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        # The Rust tokenizer decodes several times faster than the Python wrapper.
        self._fast = getattr(hf_tokenizer, "backend_tokenizer", None) or getattr(
            hf_tokenizer, "_tokenizer", None
        )
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.bos_token: str | None = hf_tokenizer.bos_token
        self.eos_token: str | None = hf_tokenizer.eos_token
        self.chat_template = (
            chat_template if chat_template is not None else _template_of(hf_tokenizer)
        )
        self.vocab_size: int = len(hf_tokenizer)
        self._literal_tokenizer: Any = None
        self.grammar_backends = GrammarBackends(self)  # built at their first use

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS the way the model wants them.
        `parse_special=False` reads special-token text (`<|im_start|>`) as plain text."""
        if parse_special:
            return list(self.hf.encode(text, add_special_tokens=add_special))
        if self._fast is None:
            return list(
                self.hf.encode(text, add_special_tokens=add_special, split_special_tokens=True)
            )
        return list(self._literal().encode(text, add_special_tokens=add_special).ids)

    def _literal(self) -> Any:
        """A copy of the Rust tokenizer that encodes special tokens as text, built at first
        use (the shared one's `encode_special_tokens` switch is not per call: flipping it
        would race with other threads' encodes)."""
        if self._literal_tokenizer is None:
            from tokenizers import Tokenizer as RustTokenizer

            assert self._fast is not None  # callers check

            copy = RustTokenizer.from_str(self._fast.to_str())
            copy.encode_special_tokens = True
            self._literal_tokenizer = copy
        return self._literal_tokenizer

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of `ids`."""
        if self._fast is not None:
            return str(self._fast.decode(list(ids), skip_special_tokens=skip_special))
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special))

    def piece(self, token_id: int) -> str:
        """The text one token stands for on its own (special tokens spelled out).

        A SentencePiece word piece keeps its leading space (`▁the` is " the", as llama.cpp
        spells pieces): decoding it alone would strip the space that starts a text."""
        text = self.decode([token_id])
        token = self.hf.convert_ids_to_tokens(token_id)
        if isinstance(token, str) and token.startswith(_METASPACE) and not text.startswith(" "):
            return " " + text
        return text

    def piece_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (partial UTF-8 sequences kept as bytes)."""
        token = self.hf.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if token.startswith("<0x") and token.endswith(">") and len(token) == 6:
            return bytes([int(token[3:5], 16)])
        byte_decoder = _byte_decoder()
        if all(ch in byte_decoder for ch in token):
            return bytes(byte_decoder[ch] for ch in token)
        return self.piece(token_id).encode("utf-8")

    def is_valid_id(self, token_id: int) -> bool:
        """Whether `token_id` names a token of this vocabulary."""
        return 0 <= token_id < self.vocab_size

    def detokenizer(
        self, context: Sequence[int] = (), *, skip_special: bool = True
    ) -> IncrementalDetokenizer:
        """A fresh streaming detokenizer seeded with the tail of `context`."""

        def decode(ids: Sequence[int]) -> str:
            return self.decode(ids, skip_special=skip_special)

        return IncrementalDetokenizer(decode, context[-_DETOKENIZER_CONTEXT:])


def _template_of(hf_tokenizer: Any) -> str | None:
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: take the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


_BYTE_DECODER: dict[str, int] | None = None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character → byte table, built once."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        printable = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        codes = printable[:]
        extra = 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                codes.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(printable, codes, strict=True)}
    return _BYTE_DECODER
