"""Structured output: JSON-schema constrained decoding behind one grammar-engine interface.

llguidance is the default engine; xgrammar is an optional extra. The serving layer parses
`response_format` with `schema_from_response_format`, compiles it once per schema with
`get_grammar_backend(name, tokenizer).compile_json_schema(schema)` (errors are HTTP 400),
and the engine masks each constrained sequence with `grammar_processor(compiled)`.
"""

from mlxcel.engine.grammar.base import (
    BACKENDS,
    DEFAULT_BACKEND,
    CacheInfo,
    CompiledGrammar,
    GrammarBackend,
    GrammarBackendUnavailable,
    GrammarMatcher,
    UnsupportedTokenizer,
    check_backend_available,
    get_grammar_backend,
)
from mlxcel.engine.grammar.limits import (
    InvalidSchema,
    SchemaLimits,
    SchemaTooLarge,
    canonical_schema,
    schema_from_response_format,
)
from mlxcel.engine.grammar.processor import (
    GrammarLogitsProcessor,
    apply_bitmask,
    grammar_processor,
    make_grammar_processor,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "CacheInfo",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarBackendUnavailable",
    "GrammarLogitsProcessor",
    "GrammarMatcher",
    "InvalidSchema",
    "SchemaLimits",
    "SchemaTooLarge",
    "UnsupportedTokenizer",
    "apply_bitmask",
    "canonical_schema",
    "check_backend_available",
    "get_grammar_backend",
    "grammar_processor",
    "make_grammar_processor",
    "schema_from_response_format",
]
