"""The optional grammar backend: xgrammar (`pip install 'mlxcel[xgrammar]'`).

xgrammar imports torch when it loads, so it is an extra and is imported only when
`--grammar-backend xgrammar` (`MLXCEL_GRAMMAR_BACKEND=xgrammar`) selects it. Its masks are
filled into the same numpy int32 bitmasks as llguidance's (through DLPack), so the logits
processor does not care which engine filled them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxcel.engine.grammar.base import (
    DEFAULT_CACHE_SIZE,
    MAX_JSON_WHITESPACE,
    CompiledGrammar,
    GrammarBackend,
    GrammarBackendUnavailable,
    GrammarMatcher,
    UnsupportedTokenizer,
    require_bpe_tokenizer,
    short_error,
)
from mlxcel.engine.grammar.limits import DEFAULT_LIMITS, InvalidSchema, SchemaLimits

# Keywords whose value is a subschema, a list of subschemas, or a name -> subschema map.
_SUBSCHEMA = (
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# Keywords xgrammar 0.2.x accepts but does not enforce.
_IGNORED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
)
_UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]")

# One decoded JSON-string character that xgrammar's regex path turns into exact UTF-8:
# no control characters, no surrogates (a negated class such as [^\x00-\x1f] admits
# malformed multi-byte sequences there).
_JSON_CHAR = "|".join(
    (
        r"[ -\u007f]",
        r"[\u0080-\u07ff]",
        r"[\u0800-\ud7ff]",
        r"[\ue000-\uffff]",
        r"[\u{10000}-\u{10ffff}]",
    )
)


def adapt_schema(schema: Any) -> Any:
    """A copy of `schema` that xgrammar (0.2.x) compiles to valid, validating JSON.

    xgrammar lowers a string with `minLength`/`maxLength` to a character class that admits
    raw control characters (a tab inside a string: invalid JSON; upstream issue #800), and
    drops the length bounds when `pattern` or `format` is also present. Lengths alone become
    the equivalent anchored `pattern` over non-control characters (its JSON-string-aware
    regex path, with classes it encodes as exact UTF-8; escapes are then not generated,
    so such strings hold no quote, backslash or control character); lengths with `pattern` or
    `format` are refused as `InvalidSchema`. `enum`, `const` and other data are left alone.
    """
    if isinstance(schema, list):
        return [adapt_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    _refuse_ignored_keywords(schema)
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = adapt_schema(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [adapt_schema(item) for item in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: adapt_schema(sub) for name, sub in out[key].items()}
    lengths = [k for k in ("minLength", "maxLength") if isinstance(out.get(k), int)]
    if not lengths:
        return out
    if "pattern" in out or "format" in out:
        raise InvalidSchema(
            "invalid JSON schema: the xgrammar backend cannot combine minLength/maxLength "
            "with pattern or format"
        )
    low = max(0, int(out.pop("minLength", 0)))
    high = out.pop("maxLength", None)
    bound = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
    out["pattern"] = f"^({_JSON_CHAR}){bound}$"
    return out


def _refuse_ignored_keywords(schema: dict[str, Any]) -> None:
    """`InvalidSchema` for what xgrammar would silently ignore (the output could then fail
    the schema): llguidance refuses the same keywords."""
    for key in _IGNORED_KEYWORDS:
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            raise InvalidSchema(f"invalid JSON schema: the xgrammar backend does not support {key}")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise InvalidSchema("invalid JSON schema: only local $ref (#/...) is supported")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _UNSUPPORTED_REGEX.search(pattern):
        raise InvalidSchema(
            "invalid JSON schema: look-around and backreferences are not supported in pattern"
        )


def import_xgrammar() -> Any:
    """The `xgrammar` module; `GrammarBackendUnavailable` (one line) when it cannot load."""
    try:
        import xgrammar
    except Exception as exc:  # ImportError, or torch failing inside xgrammar's import
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GrammarBackendUnavailable(
            f"the xgrammar grammar backend is not available ({reason}); install it with "
            "pip install 'mlxcel[xgrammar]' (it needs torch) or use --grammar-backend llguidance"
        ) from None
    return xgrammar


class XGrammarMatcher(GrammarMatcher):
    """An `xgrammar.GrammarMatcher` behind the common interface."""

    def __init__(self, matcher: Any) -> None:
        self.xg = matcher
        self._error: str | None = None

    def fill_bitmask(self, bitmask: np.ndarray, row: int = 0) -> None:
        self.xg.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if self._error is not None:
            return False
        ok = bool(self.xg.accept_token(int(token_id)))
        if not ok:
            self._error = f"token {int(token_id)} is not allowed by the grammar"
        return ok

    def is_terminated(self) -> bool:
        return bool(self.xg.is_terminated())

    @property
    def error(self) -> str | None:
        return self._error


class XGrammarGrammar(CompiledGrammar):
    """An `xgrammar.CompiledGrammar`; each matcher is built from it."""

    def __init__(self, backend: XGrammarBackend, compiled: Any) -> None:
        self.backend = backend
        self._xgr = backend._xgr
        self._compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    """xgrammar over a Hugging Face fast BPE tokenizer."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: SchemaLimits = DEFAULT_LIMITS,
        max_threads: int = 2,
    ) -> None:
        """`tokenizer` is an `mlxcel.engine.tokenizer.Tokenizer` (its `.hf` is used)."""
        xgr = import_xgrammar()
        hf = tokenizer.hf
        require_bpe_tokenizer(hf)
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        try:
            info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=eos or None)
        except Exception as exc:
            raise UnsupportedTokenizer(
                "UnsupportedTokenizer: this model's tokenizer cannot drive constrained "
                f"decoding ({short_error(exc, 100)})"
            ) from None
        super().__init__(info.vocab_size, info.stop_token_ids, cache_size=cache_size, limits=limits)
        self._xgr = xgr
        # Our own LRU caches compiled grammars; xgrammar's cache would only duplicate it.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._batch: Any = None

    def _compile_json_schema(self, schema_json: str) -> XGrammarGrammar:
        adapted = json.dumps(adapt_schema(json.loads(schema_json)), ensure_ascii=False)
        try:
            compiled = self._compiler.compile_json_schema(
                adapted,
                any_whitespace=True,
                max_whitespace_cnt=MAX_JSON_WHITESPACE,
                strict_mode=False,  # JSON Schema semantics, as llguidance
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidSchema(f"invalid JSON schema: {short_error(exc)}") from None
        return XGrammarGrammar(self, compiled)

    def fill_masks(
        self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray
    ) -> None:
        """One multi-threaded fill of every row (xgrammar's `BatchGrammarMatcher`)."""
        if len(matchers) < 2 or not all(isinstance(m, XGrammarMatcher) for m, _ in matchers):
            super().fill_masks(matchers, bitmask)
            return
        if self._batch is None:
            self._batch = self._xgr.BatchGrammarMatcher()
        handles = [m.xg for m, _ in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(
            handles, bitmask, indices=[int(row) for _, row in matchers]
        )
