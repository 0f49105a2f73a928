"""The default grammar backend: llguidance (Rust, torch-free, numpy bitmasks).

llguidance's regexes are derivative-based automata with fuel limits, so a schema `pattern`
such as `(a+)+$` cannot backtrack catastrophically; a lexer that runs out of fuel puts the
matcher in an error state instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxcel.engine.grammar.base import (
    DEFAULT_CACHE_SIZE,
    JSON_WHITESPACE_PATTERN,
    CompiledGrammar,
    GrammarBackend,
    GrammarBackendUnavailable,
    GrammarMatcher,
    UnsupportedTokenizer,
    require_bpe_tokenizer,
    short_error,
)
from mlxcel.engine.grammar.limits import DEFAULT_LIMITS, InvalidSchema, SchemaLimits

# JSON compile options that a schema's own "x-guidance" block cannot loosen.
_JSON_OVERRIDES = {
    "whitespace_pattern": JSON_WHITESPACE_PATTERN,
    "lenient": False,  # an unimplemented keyword is an error, not silently ignored
}


def import_llguidance() -> Any:
    """The `llguidance` module; `GrammarBackendUnavailable` when it cannot be imported."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError as exc:
        raise GrammarBackendUnavailable(
            f"the llguidance grammar backend is not installed ({exc}); pip install llguidance"
        ) from None
    return llguidance


class LLGuidanceMatcher(GrammarMatcher):
    """An `llguidance.LLMatcher` behind the common interface."""

    def __init__(self, matcher: Any) -> None:
        self.ll = matcher

    def fill_bitmask(self, bitmask: np.ndarray, row: int = 0) -> None:
        target = bitmask[row]
        if target.dtype != np.int32 or not target.flags["C_CONTIGUOUS"]:
            raise ValueError("the bitmask must be a C-contiguous int32 array")
        self.ll.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def accept(self, token_id: int) -> bool:
        return bool(self.ll.consume_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self.ll.is_stopped())

    @property
    def error(self) -> str | None:
        return (str(self.ll.get_error()) or "error") if self.ll.is_error() else None


class LLGuidanceGrammar(CompiledGrammar):
    """A validated grammar: a pristine matcher that every new sequence deep-copies."""

    def __init__(self, backend: LLGuidanceBackend, template: Any) -> None:
        self.backend = backend
        self._template = template
        self._lock = threading.Lock()

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    """llguidance over a Hugging Face fast BPE tokenizer."""

    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: SchemaLimits = DEFAULT_LIMITS,
    ) -> None:
        """`tokenizer` is an `mlxcel.engine.tokenizer.Tokenizer` (its `.hf` is used)."""
        llg = import_llguidance()
        hf = tokenizer.hf
        require_bpe_tokenizer(hf)
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        try:
            self._tokenizer = llg.hf.from_tokenizer(hf, eos_token=eos or None)
        except Exception as exc:  # the token table could not be built: not a usable BPE
            raise UnsupportedTokenizer(
                "UnsupportedTokenizer: this model's tokenizer cannot drive constrained "
                f"decoding ({short_error(exc, 100)})"
            ) from None
        super().__init__(
            self._tokenizer.vocab_size,
            self._tokenizer.eos_tokens,
            cache_size=cache_size,
            limits=limits,
        )
        self._llg = llg
        # No schema or parser state in error messages: they may reach a client or a log.
        self._parser_limits = llg.LLParserLimits(verbose_errors=False)
        self._executor: Any = None

    def _compile_json_schema(self, schema_json: str) -> LLGuidanceGrammar:
        matcher_cls = self._llg.LLMatcher
        try:
            grammar = matcher_cls.grammar_from_json_schema(schema_json, overrides=_JSON_OVERRIDES)
        except (ValueError, TypeError) as exc:
            raise InvalidSchema(f"invalid JSON schema: {short_error(exc)}") from None
        # Building the matcher compiles the grammar and its lexer (the GIL is released);
        # llguidance never raises for grammar errors, it reports them through is_error().
        template = matcher_cls(self._tokenizer, grammar, log_level=0, limits=self._parser_limits)
        self._check_template(template, "invalid JSON schema")
        return LLGuidanceGrammar(self, template)

    supports_lark = True

    def _compile_lark(self, grammar: str) -> LLGuidanceGrammar:
        matcher_cls = self._llg.LLMatcher
        try:
            compiled = matcher_cls.grammar_from_lark(grammar)
        except (ValueError, TypeError) as exc:
            raise InvalidSchema(f"invalid grammar: {short_error(exc)}") from None
        template = matcher_cls(self._tokenizer, compiled, log_level=0, limits=self._parser_limits)
        self._check_template(template, "invalid grammar")
        return LLGuidanceGrammar(self, template)

    def _check_template(self, template: Any, what: str) -> None:
        """`InvalidSchema` for a grammar llguidance built but cannot start: its first mask
        puts a copy in an error state. A `$ref` cycle that never reaches a type (`{"$ref":
        "#"}`) or GBNF rules that only name each other compile, then allow nothing but the
        end token: the answer was an empty 200 that no schema accepts."""
        if not template.is_error():
            probe, mask = template.deep_copy(), self.allocate_bitmask()  # `mask` outlives the call
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if not probe.is_error():
                return
            raise InvalidSchema(f"{what}: it admits no output ({short_error(probe.get_error())})")
        raise InvalidSchema(f"{what}: {short_error(template.get_error())}")

    def is_special_token(self, token_id: int) -> bool:
        """True when `token_id` is a special token (which grammar literals cannot spell)."""
        return bool(self._tokenizer.is_special_token(int(token_id)))

    def fill_masks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray
    ) -> None:
        """One parallel fill of every row (llguidance's `LLExecutor`)."""
        if len(matchers) < 2 or not all(isinstance(m, LLGuidanceMatcher) for m, _ in matchers):
            super().fill_masks(matchers, bitmask)
            return
        if bitmask.dtype != np.int32 or not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("the bitmask must be a C-contiguous int32 array")
        if self._executor is None:
            self._executor = self._llg.LLExecutor()
        pairs = [(m.ll, int(row)) for m, row in matchers]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )
