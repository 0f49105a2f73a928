"""Constrained decoding as an mlx-lm logits processor.

`GrammarLogitsProcessor` is called the way mlx-lm's `BatchGenerator` (and `generate_step`)
call logits processors, once per step and sequence: `processor(tokens, logits) -> logits`,
where `tokens` is the sequence so far (prompt included) and `logits` is `[1, V]`. It advances
its matcher on the tokens that arrived since its previous call (the first call only records
the prompt length), then sets every token the grammar does not allow to -inf. Once the
grammar is complete only end-of-sequence tokens remain, so the sequence stops.

It never raises: a matcher error (which masking makes unreachable in normal use) is logged
once, recorded in `.error`, and the sequence is ended with an end-of-sequence token, so one
bad sequence cannot fail the whole batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from mlxcel.engine.grammar.base import (
    DEFAULT_BACKEND,
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    get_grammar_backend,
)

log = logging.getLogger(__name__)


def unpack_bitmask(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """A `[rows, vocab]` bool array from an int32 `[rows, words]` bitmask.

    Columns past the bitmask (a model whose logits are wider than its tokenizer's
    vocabulary) are False; columns past `vocab` are dropped.
    """
    rows = bitmask.reshape(bitmask.shape[0], -1)
    # Little-endian words: byte k of word j holds tokens 32j + 8k ... 32j + 8k + 7.
    bits = np.unpackbits(rows.astype("<i4", copy=False).view(np.uint8), axis=-1, bitorder="little")
    width = bits.shape[-1]
    if width >= vocab:
        return bits[:, :vocab].view(np.bool_)
    out = np.zeros((rows.shape[0], vocab), dtype=np.bool_)
    out[:, :width] = bits.view(np.bool_)
    return out


def apply_bitmask(logits: Any, bitmask: np.ndarray) -> Any:
    """`logits` (`[B, V]` mx.array) with the tokens `bitmask` (`[B, words]`) disallows at -inf."""
    import mlx.core as mx

    allowed = mx.array(unpack_bitmask(bitmask, int(logits.shape[-1])))
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarLogitsProcessor:
    """Masks one sequence's logits to what its grammar allows next (see the module doc).

    One per sequence (it owns the matcher's state). `error` is None unless the matcher
    failed. `mask_seconds` / `masked_steps`: host time spent in the processor, which
    includes waiting for the previous step's token (the one sync constrained decoding needs).
    """

    def __init__(self, matcher: GrammarMatcher, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.error: str | None = None
        self.mask_seconds = 0.0
        self.masked_steps = 0
        self._bitmask = backend.allocate_bitmask(1)
        self._eos = backend.eos_token_ids
        self._eos_masks: dict[int, Any] = {}
        self._seen: int | None = None

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        start = time.perf_counter()
        try:
            # Start this step's forward pass before waiting for the previous token on the
            # host: the mask is then computed while the model runs, not after it.
            mx.async_eval(logits)
            self._advance(tokens)
            if self.error is not None or self.matcher.is_terminated():
                out = self._only_eos(logits)
            else:
                self.matcher.fill_bitmask(self._bitmask, 0)
                out = apply_bitmask(logits, self._bitmask)
        except Exception as exc:  # never fail the batch for one sequence
            self._fail(f"{type(exc).__name__}: {exc}")
            out = self._only_eos(logits)
        self.mask_seconds += time.perf_counter() - start
        self.masked_steps += 1
        return out

    def _advance(self, tokens: Any) -> None:
        n = int(tokens.size)
        if self._seen is None:  # the first call: the prompt, which the grammar does not see
            self._seen = n
            return
        if n <= self._seen:
            return
        new: list[int] = tokens[self._seen : n].tolist()
        self._seen = n
        for token in new:
            if self.error is not None:
                return
            if self.matcher.is_terminated():
                continue  # only end-of-sequence tokens follow (kept going by ignore_eos)
            if not self.matcher.accept(token):
                self._fail(self.matcher.error or f"token {token} was not allowed")

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason.splitlines()[0][:200] if reason else "grammar error"
            log.warning("constrained decoding stopped a sequence: %s", self.error)

    def _only_eos(self, logits: Any) -> Any:
        import mlx.core as mx

        vocab = int(logits.shape[-1])
        mask = self._eos_masks.get(vocab)
        if mask is None:
            allowed = np.zeros(vocab, dtype=np.bool_)
            ids = [t for t in self._eos if 0 <= t < vocab]
            if not ids:  # nothing to force: leave the logits alone
                return logits
            allowed[ids] = True
            mask = self._eos_masks[vocab] = mx.array(allowed[None, :])
        return mx.where(mask, logits, mx.array(-mx.inf, dtype=logits.dtype))


def grammar_processor(compiled: CompiledGrammar) -> GrammarLogitsProcessor:
    """A fresh processor (its own matcher) for one sequence constrained by `compiled`."""
    return GrammarLogitsProcessor(compiled.matcher(), compiled.backend)


def make_grammar_processor(
    tokenizer: Any,
    response_format_schema: Mapping[str, Any] | str,
    backend: GrammarBackend | str = DEFAULT_BACKEND,
) -> GrammarLogitsProcessor:
    """Compile `response_format_schema` (cached) and return a processor for one sequence.

    `tokenizer` is the model's `mlxcel.engine.tokenizer.Tokenizer`; `backend` is a backend
    or its name ("llguidance", "xgrammar"). Raises `SchemaTooLarge`, `InvalidSchema`,
    `UnsupportedTokenizer` (HTTP 400) or `GrammarBackendUnavailable`.
    """
    if isinstance(backend, str):
        backend = get_grammar_backend(backend, tokenizer)
    return grammar_processor(backend.compile_json_schema(response_format_schema))
