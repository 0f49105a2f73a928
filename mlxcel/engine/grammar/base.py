"""The grammar-engine interface that constrained decoding is written against.

A `GrammarBackend` is built once per tokenizer (its token table is the expensive part). It
compiles a JSON schema once into a `CompiledGrammar` (kept in an LRU keyed by the schema's
compact JSON), and every sequence that uses the schema gets its own `GrammarMatcher`:

    backend = get_grammar_backend("llguidance", tokenizer)
    compiled = backend.compile_json_schema(schema)      # limits, then compile (cached)
    matcher = compiled.matcher()                        # per sequence
    bitmask = backend.allocate_bitmask(n_rows)          # int32 [rows, ceil(vocab / 32)]
    backend.fill_masks([(matcher, 0)], bitmask)         # all constrained rows at once
    matcher.accept(token_id)                            # advance on the sampled token

Bit `t % 32` of word `t // 32` of a row is set when token `t` is allowed.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mlxcel.engine.errors import EngineError, InvalidRequestError
from mlxcel.engine.grammar.limits import DEFAULT_LIMITS, SchemaLimits, canonical_schema
from mlxcel.engine.grammar.strict import llama_cpp_schema

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer

BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"
DEFAULT_CACHE_SIZE = 64
# Whitespace allowed between two JSON tokens, the SPACE rule of llama.cpp's
# json-schema-to-grammar: nothing, one space, or one line feed followed by up to 20 spaces
# or tabs (never a carriage return, never a blank line). Bounded, so that a schema whose
# values are bounded also bounds the output (an endless run of spaces is how a weak model
# fails to finish), while compact and pretty-printed JSON both fit. Every grammar mlxcel
# builds with llguidance (response_format, forced tool calls, json_object) uses this one
# pattern; the xgrammar extra's API only bounds the count, to MAX_JSON_WHITESPACE.
JSON_WHITESPACE_PATTERN = r"(\x20|\x0A[\x20\x09]{0,20})?"
MAX_JSON_WHITESPACE = 21


class UnsupportedTokenizer(InvalidRequestError):
    """Constrained decoding needs a Hugging Face BPE tokenizer (HTTP 400)."""

    code = "UnsupportedTokenizer"


class GrammarBackendUnavailable(EngineError):
    """The selected grammar backend cannot be imported (a server configuration error)."""


@dataclass(frozen=True)
class CacheInfo:
    """Compiled-grammar cache counters."""

    hits: int
    misses: int
    size: int
    capacity: int


class GrammarMatcher(ABC):
    """The grammar state of one sequence."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int = 0) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, C-contiguous)."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance on `token_id`; False when the grammar does not allow it (an error state)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when nothing but end-of-sequence can follow."""

    @property
    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher is in an error state (None when it is not)."""


class CompiledGrammar(ABC):
    """A grammar compiled against one backend's tokenizer; shared, read-only."""

    backend: GrammarBackend

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(ABC):
    """One grammar engine bound to one tokenizer."""

    name: str = ""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: SchemaLimits = DEFAULT_LIMITS,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(set(eos_token_ids)))
        self.limits = limits
        self._capacity = max(1, cache_size)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    # ------------------------------------------------------------------ compilation

    def compile_json_schema(self, schema: Mapping[str, Any] | str) -> CompiledGrammar:
        """Check the limits, then compile `schema` (or return the cached grammar).

        The schema is read as llama.cpp reads it (`llama_cpp_schema`): objects with
        `properties` take no other key unless the schema allows them, integers without
        bounds have at most 16 digits. Raises `SchemaTooLarge` / `InvalidSchema` (both HTTP
        400) with short messages.
        """
        checked = canonical_schema(schema, self.limits)
        key = json.dumps(llama_cpp_schema(json.loads(checked)), separators=(",", ":"))
        return self._cached(key, lambda: self._compile_json_schema(key))

    def compile_lark(self, grammar: str) -> CompiledGrammar:
        """Compile a Lark grammar (llguidance's dialect; `%json {...}` embeds a schema).

        Only backends with `supports_lark` implement it; the caller checks the embedded
        schemas against the limits first. Raises `InvalidSchema` when it is rejected.
        """
        if not self.supports_lark:
            raise NotImplementedError(f"the {self.name} backend does not compile Lark grammars")
        return self._cached("lark:" + grammar, lambda: self._compile_lark(grammar))

    supports_lark: bool = False
    """True when `compile_lark` works (llguidance); xgrammar has no Lark front end."""

    def _compile_lark(self, grammar: str) -> CompiledGrammar:
        raise NotImplementedError

    def is_special_token(self, token_id: int) -> bool:
        """True when `token_id` is a special token (grammar literals cannot spell those)."""
        return False

    def _cached(self, key: str, build: Callable[[], CompiledGrammar]) -> CompiledGrammar:
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return cached
            self._misses += 1
        compiled = build()
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return compiled

    @abstractmethod
    def _compile_json_schema(self, schema_json: str) -> CompiledGrammar:
        """Compile a schema that passed the limits; raise `InvalidSchema` if it is rejected."""

    def cache_info(self) -> CacheInfo:
        """Hits, misses and size of the compiled-grammar cache."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self._capacity)

    # ----------------------------------------------------------------------- masks

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def allocate_bitmask(self, rows: int = 1) -> np.ndarray:
        """An all-allowed int32 bitmask of `rows` rows."""
        return np.full((rows, self.bitmask_width), -1, dtype=np.int32)

    def fill_masks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray
    ) -> None:
        """Fill `bitmask[row]` for every `(matcher, row)`: all constrained rows of a step.

        Backends override this with their parallel batch fill.
        """
        for matcher, row in matchers:
            matcher.fill_bitmask(bitmask, row)


def short_error(message: object, limit: int = 160) -> str:
    """A grammar engine's error as one short line (its last `error:` line when it has one)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("<")]  # e.g. <non-verbose/>
    tagged = [line for line in lines if line.startswith("error:")]
    text = tagged[-1] if tagged else (lines[0] if lines else "rejected by the grammar engine")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require_bpe_tokenizer(hf_tokenizer: Any) -> Any:
    """The Rust `tokenizers.Tokenizer` behind `hf_tokenizer`; `UnsupportedTokenizer` unless it
    is a Hugging Face fast tokenizer with a BPE model (what `tokenizer.json` describes)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedTokenizer(
            "UnsupportedTokenizer: response_format needs a Hugging Face BPE tokenizer "
            f"(tokenizer.json); this model uses {type(hf_tokenizer).__name__}"
        )
    model = type(getattr(backend, "model", None)).__name__
    if model != "BPE":
        raise UnsupportedTokenizer(
            "UnsupportedTokenizer: response_format needs a Hugging Face BPE tokenizer "
            f"(tokenizer.json); this model's tokenizer is {model}"
        )
    return backend


def check_backend_available(name: str) -> None:
    """Import the grammar engine `name`; `GrammarBackendUnavailable` (one line) if it can't.

    Call at server start-up for the configured backend (xgrammar imports torch, so this is
    slow for it, and only done when it is selected).
    """
    if name == "llguidance":
        from mlxcel.engine.grammar.llguidance_backend import import_llguidance

        import_llguidance()
    elif name == "xgrammar":
        from mlxcel.engine.grammar.xgrammar_backend import import_xgrammar

        import_xgrammar()
    else:
        raise GrammarBackendUnavailable(
            f"unknown grammar backend {name!r}; choose one of {', '.join(BACKENDS)}"
        )


class GrammarBackends:
    """One tokenizer's grammar backends (held by its `Tokenizer`), each built at its first
    use and kept: building one converts the whole vocabulary (about 2 s for a 49k-token
    vocabulary on a small CPU). A tokenizer a backend cannot drive is remembered too."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._built: dict[str, GrammarBackend | InvalidRequestError] = {}

    def get(self, name: str) -> GrammarBackend:
        """The backend `name`; `UnsupportedTokenizer` (HTTP 400) or
        `GrammarBackendUnavailable` when there is none."""
        with self._lock:
            found = self._built.get(name)
            if found is None:
                try:
                    found = _new_backend(name, self._tokenizer)
                except UnsupportedTokenizer as exc:
                    found = exc
                self._built[name] = found
        if isinstance(found, InvalidRequestError):
            raise type(found)(str(found))
        return found


def get_grammar_backend(name: str, tokenizer: Tokenizer) -> GrammarBackend:
    """The backend `name` for `tokenizer`, built once (`Tokenizer.grammar_backends`).

    Raises `UnsupportedTokenizer` (HTTP 400) or `GrammarBackendUnavailable`.
    """
    return tokenizer.grammar_backends.get(name)


def _new_backend(name: str, tokenizer: Tokenizer) -> GrammarBackend:
    if name == "llguidance":
        from mlxcel.engine.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer)
    if name == "xgrammar":
        from mlxcel.engine.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer)
    raise GrammarBackendUnavailable(
        f"unknown grammar backend {name!r}; choose one of {', '.join(BACKENDS)}"
    )
