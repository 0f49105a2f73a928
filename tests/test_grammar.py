"""Structured output: JSON-schema constrained decoding (mlxcel.engine.grammar)."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.grammar import (
    CompiledGrammar,
    GrammarBackend,
    GrammarBackendUnavailable,
    GrammarLogitsProcessor,
    InvalidSchema,
    SchemaTooLarge,
    UnsupportedTokenizer,
    check_backend_available,
    get_grammar_backend,
    grammar_processor,
    make_grammar_processor,
    schema_from_response_format,
)
from mlxcel.engine.grammar.limits import MAX_SCHEMA_BYTES, canonical_schema

_XGRAMMAR_MISSING = [m for m in ("xgrammar", "torch") if importlib.util.find_spec(m) is None]
HAS_XGRAMMAR = not _XGRAMMAR_MISSING
XGRAMMAR_SKIP = (
    "the optional xgrammar backend (pip install 'mlxcel[xgrammar]', which needs torch) is "
    f"not usable here: {' and '.join(_XGRAMMAR_MISSING)} not installed"
)
BACKENDS = [
    pytest.param("llguidance", id="llguidance"),
    pytest.param(
        "xgrammar",
        id="xgrammar",
        marks=pytest.mark.skipif(not HAS_XGRAMMAR, reason=XGRAMMAR_SKIP),
    ),
]

# Every value is bounded, so the grammar itself has to end the output.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 4},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "pos": {"$ref": "#/$defs/point"},
        "note": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    },
    "required": ["kind", "age", "ok", "name", "pos"],
    "additionalProperties": False,
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        }
    },
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


def _allowed(processor: GrammarLogitsProcessor, tokens: list[int], vocab: int) -> set[int]:
    """Token ids left finite after `processor` saw `tokens`."""
    import mlx.core as mx

    out = processor(mx.array(tokens, dtype=mx.int32), mx.zeros((1, vocab)))
    return set(np.flatnonzero(np.isfinite(np.array(out[0]))).tolist())


def _generate(
    tiny: Any, compiled: CompiledGrammar, n: int, max_tokens: int
) -> list[tuple[str | None, list[int], GrammarLogitsProcessor]]:
    """`n` constrained sequences in one BatchGenerator, inserted the way the scheduler does.

    Prompt i is random tokens from seed i; one seeded temperature-1 sampler serves the batch.
    """
    from mlx_lm.generate import BatchGenerator, StopSequences

    from mlxcel.engine.sampling.chain import make_sampling
    from mlxcel.engine.sampling.params import SamplingParams

    tokenizer = tiny.tokenizer
    sampler, _ = make_sampling(SamplingParams(temperature=1.0, seed=1234), tokenizer.vocab_size)
    generator = BatchGenerator(
        tiny.model, completion_batch_size=n, prefill_batch_size=n, sampler=sampler
    )
    eos = StopSequences([[t] for t in sorted(tokenizer.eos_token_ids)])
    rows: dict[int, tuple[list[int], GrammarLogitsProcessor]] = {}
    for seed in range(n):
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(3, tokenizer.vocab_size, size=rng.integers(2, 9))]
        processor = grammar_processor(compiled)
        (uid,) = generator.insert(
            [prompt], max_tokens=[max_tokens], logits_processors=[[processor]], stop_sequences=[eos]
        )
        rows[uid] = ([], processor)
    finished: dict[int, str] = {}
    while len(finished) < n:
        _, responses = generator.next()
        for r in responses:
            if r.finish_reason is not None:
                finished[r.uid] = r.finish_reason
                if r.finish_reason == "stop":
                    continue  # the end-of-sequence token is not output
            rows[r.uid][0].append(int(r.token))
    return [(finished[uid], out, proc) for uid, (out, proc) in rows.items()]


# ------------------------------------------------------------------------- generation


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_json_schema_output_validates_for_50_seeds(tiny: Any, backend_name: str) -> None:
    import jsonschema

    backend = get_grammar_backend(backend_name, tiny.tokenizer)
    compiled = backend.compile_json_schema(SCHEMA)
    # xgrammar can only bound the whitespace count per gap (not its shape), and a random
    # model spends much of that budget, so its outputs are longer.
    budget = 256 if backend_name == "llguidance" else 1024
    results = _generate(tiny, compiled, n=50, max_tokens=budget)
    texts = set()
    for reason, tokens, processor in results:
        text = tiny.tokenizer.decode(tokens, skip_special=True)
        assert reason == "stop", f"the grammar did not end the output: {text!r}"
        assert processor.error is None
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.add(text)
    assert len(texts) > 10  # 50 different sequences, not one output repeated


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_complete_grammar_allows_only_eos(tiny: Any, backend_name: str) -> None:
    tokenizer = tiny.tokenizer
    processor = make_grammar_processor(tokenizer, {"type": "boolean"}, backend_name)
    vocab = tokenizer.vocab_size
    prompt = [5, 6, 7]
    first = _allowed(processor, prompt, vocab)
    assert first and not first & tokenizer.eos_token_ids  # an empty value is not JSON
    body = tokenizer.encode("true", add_special=False)
    assert _allowed(processor, prompt + body, vocab) == set(tokenizer.eos_token_ids)


def test_masks_padded_vocabulary_and_unknown_tokens(tiny: Any) -> None:
    tokenizer = tiny.tokenizer
    processor = make_grammar_processor(tokenizer, {"enum": ["cat", "dog"]})
    wide = tokenizer.vocab_size + 45  # a model whose logits are wider than its tokenizer
    allowed = _allowed(processor, [5], wide)
    assert allowed and max(allowed) < tokenizer.vocab_size
    pieces = {tokenizer.decode([t]) for t in allowed}
    assert all('"cat"'.startswith(p) or '"dog"'.startswith(p) for p in pieces), pieces


def test_disallowed_token_ends_the_sequence_without_raising(tiny: Any) -> None:
    tokenizer = tiny.tokenizer
    processor = make_grammar_processor(tokenizer, {"type": "integer"})
    quote = tokenizer.encode('"', add_special=False)
    assert _allowed(processor, [5], tokenizer.vocab_size)
    assert _allowed(processor, [5, *quote], tokenizer.vocab_size) == set(tokenizer.eos_token_ids)
    assert processor.error


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fill_masks_fills_all_rows_together(tiny: Any, backend_name: str) -> None:
    tokenizer = tiny.tokenizer
    backend = get_grammar_backend(backend_name, tokenizer)
    compiled = backend.compile_json_schema(SCHEMA)
    prefixes = ["", '{"kind": "d', '{"kind": "cat", "age": 1']
    matchers = []
    for prefix in prefixes:
        matcher = compiled.matcher()
        assert all(matcher.accept(t) for t in tokenizer.encode(prefix, add_special=False))
        matchers.append(matcher)
    batched = backend.allocate_bitmask(4)
    backend.fill_masks([(m, row) for row, m in zip((3, 0, 1), matchers, strict=True)], batched)
    for row, matcher in zip((3, 0, 1), matchers, strict=True):
        single = backend.allocate_bitmask(1)
        matcher.fill_bitmask(single, 0)
        np.testing.assert_array_equal(batched[row], single[0])
    assert (batched[2] == -1).all()  # a row no matcher owns is left alone
    assert not np.array_equal(batched[3], batched[0])


# ----------------------------------------------------------------------- untrusted input


class _CountingBackend(GrammarBackend):
    """A backend that only counts compilations (to see that limits come first)."""

    name = "counting"

    def __init__(self, cache_size: int = 64) -> None:
        super().__init__(64, [0], cache_size=cache_size)
        self.compiled: list[str] = []

    def _compile_json_schema(self, schema_json: str) -> CompiledGrammar:
        self.compiled.append(schema_json)
        grammar = _StubGrammar()
        grammar.backend = self
        return grammar


class _StubGrammar(CompiledGrammar):
    def matcher(self) -> Any:
        raise NotImplementedError


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"not": schema}
    return schema


def _with_refs(count: int) -> dict[str, Any]:
    props = {f"p{i}": {"$ref": "#/$defs/v"} for i in range(count)}
    return {"type": "object", "properties": props, "$defs": {"v": {"type": "integer"}}}


def _big(n_bytes: int) -> dict[str, Any]:
    secret = "zebra-" * 40
    items = [f"{secret}{i:06d}" for i in range(n_bytes // len(secret) + 1)]
    return {"enum": items}


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (_big(MAX_SCHEMA_BYTES), "larger than 64 KiB"),
        (_nested(33), "more than 32 levels"),
        (_with_refs(65), "65 $ref entries; the limit is 64"),
    ],
    ids=["size", "depth", "refs"],
)
def test_limits_refuse_before_compiling_without_echoing(schema: Any, message: str) -> None:
    backend = _CountingBackend()
    with pytest.raises(SchemaTooLarge) as info:
        backend.compile_json_schema(schema)
    text = str(info.value)
    assert message in text
    assert isinstance(info.value, InvalidRequestError)  # HTTP 400
    assert "zebra" not in text and "$defs" not in text and "p64" not in text
    assert len(text) < 120 and "\n" not in text
    assert backend.compiled == []
    with pytest.raises(SchemaTooLarge):  # the same as JSON text
        backend.compile_json_schema(json.dumps(schema))


def test_limits_accept_schemas_at_the_limit() -> None:
    backend = _CountingBackend()
    backend.compile_json_schema(_nested(32))
    backend.compile_json_schema(_with_refs(64))
    at_limit = _big(1000)
    filler = MAX_SCHEMA_BYTES - len(canonical_schema(at_limit).encode())
    at_limit["description"] = "x" * (filler - len(',"description":""'))
    assert len(canonical_schema(at_limit).encode()) == MAX_SCHEMA_BYTES
    backend.compile_json_schema(at_limit)
    assert len(backend.compiled) == 3
    at_limit["description"] += "x"
    with pytest.raises(SchemaTooLarge):
        backend.compile_json_schema(at_limit)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        {"type": "string", "pattern": "[unclosed"},
        {"type": "string", "pattern": "(?=lookahead)x"},
        {"type": "strin"},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"$ref": "https://example.invalid/remote.json"},
        {"$ref": "#/$defs/missing"},
    ],
    ids=["not", "bad-regex", "lookaround", "bad-type", "unsatisfiable", "remote-ref", "dangling"],
)
def test_rejected_schema_is_a_clean_400(
    tiny: Any, backend_name: str, schema: dict[str, Any]
) -> None:
    backend = get_grammar_backend(backend_name, tiny.tokenizer)
    with pytest.raises(InvalidSchema) as info:
        backend.compile_json_schema(schema)
    text = str(info.value)
    assert isinstance(info.value, InvalidRequestError)
    assert text.startswith("invalid JSON schema: ") and "\n" not in text and len(text) < 200


@pytest.mark.parametrize(
    ("compile_", "source"),
    [
        ("json", {"$ref": "#"}),
        (
            "json",
            {
                "$ref": "#/$defs/a",
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
            },
        ),
        ("gbnf", "root ::= a\na ::= b\nb ::= a"),
    ],
    ids=["self-ref", "ref-cycle", "gbnf-cycle"],
)
def test_grammar_that_admits_nothing_is_a_400(tiny: Any, compile_: str, source: Any) -> None:
    """llguidance compiles a reference cycle that never reaches a value, then its first mask
    fails and only the end token is left: the request was a 200 with empty content that no
    schema accepts. It is refused at compile time; a grammar that may end at once is not."""
    from mlxcel.engine.grammar.gbnf import compile_gbnf

    backend = get_grammar_backend("llguidance", tiny.tokenizer)
    with pytest.raises(InvalidSchema, match=r"^invalid (JSON schema|grammar): it admits no output"):
        if compile_ == "json":
            backend.compile_json_schema(source)
        else:
            compile_gbnf(backend, source)
    matcher = compile_gbnf(backend, 'root ::= ""').matcher()
    mask = backend.allocate_bitmask()
    matcher.fill_bitmask(mask)
    assert matcher.error is None


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize(
    "pattern",
    ["^(a+)+$", "^(a|aa)+$", "^(a|a)*b$", "^(\\w+\\s?)*$", "(.*a){12}", "^((a*)*)*c$"],
)
def test_hostile_patterns_run_in_bounded_time(tiny: Any, backend_name: str, pattern: str) -> None:
    """Catastrophic-backtracking regexes: compile and 40 masked steps finish, or a clean 400."""
    tokenizer = tiny.tokenizer
    backend = get_grammar_backend(backend_name, tokenizer)
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": pattern, "maxLength": 40}},
        "required": ["s"],
        "additionalProperties": False,
    }
    a_tokens = tokenizer.encode("a", add_special=False)
    outcome: list[str] = []

    def attack() -> None:
        try:
            matcher = backend.compile_json_schema(schema).matcher()
        except InvalidSchema:
            outcome.append("rejected")
            return
        prefix = tokenizer.encode('{"s": "', add_special=False)
        assert all(matcher.accept(t) for t in prefix)
        bitmask = backend.allocate_bitmask(1)
        for _ in range(40):  # feed "aaaa..." and ask for the next mask each time
            matcher.fill_bitmask(bitmask, 0)
            if matcher.is_terminated() or not matcher.accept(a_tokens[0]):
                break
        outcome.append("ran")

    _time_boxed(attack, seconds=60)
    assert outcome in (["ran"], ["rejected"])


def _time_boxed(target: Callable[[], None], seconds: float) -> None:
    failure: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported to the test thread
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if failure:
        raise failure[0]


# --------------------------------------------------------------------------- tokenizers


def _word_level_tokenizer() -> Any:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mlxcel.engine.tokenizer import Tokenizer

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="</s>", unk_token="[UNK]")
    return Tokenizer(hf)


class _SlowTokenizerStandIn:
    """What a SentencePiece / tiktoken tokenizer looks like here: no Rust backend."""

    eos_token_ids = frozenset({1})

    def __init__(self) -> None:
        from mlxcel.engine.grammar.base import GrammarBackends

        self.hf = type("SentencePieceTokenizer", (), {})()
        self.grammar_backends = GrammarBackends(self)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("make", [_word_level_tokenizer, _SlowTokenizerStandIn])
def test_non_bpe_tokenizer_is_unsupported(backend_name: str, make: Callable[[], Any]) -> None:
    tokenizer = make()
    for _ in range(2):  # the answer is remembered, and raised again
        with pytest.raises(UnsupportedTokenizer) as info:
            make_grammar_processor(tokenizer, {"type": "integer"}, backend_name)
        assert isinstance(info.value, InvalidRequestError)
        assert "UnsupportedTokenizer" in str(info.value)
        assert "BPE" in str(info.value)


def test_unknown_or_missing_backend_is_a_one_line_error(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.engine.tokenizer import Tokenizer

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if the extra were not installed
    fresh = Tokenizer(tiny.tokenizer.hf)  # no backend cached for it yet
    for call in (
        lambda: check_backend_available("xgrammar"),
        lambda: get_grammar_backend("xgrammar", fresh),
    ):
        with pytest.raises(GrammarBackendUnavailable) as info:
            call()
        text = str(info.value)
        assert "\n" not in text and "mlxcel[xgrammar]" in text and "llguidance" in text
    with pytest.raises(GrammarBackendUnavailable, match="unknown grammar backend"):
        check_backend_available("outlines")
    check_backend_available("llguidance")


# -------------------------------------------------------------------------------- cache


def test_compiled_grammar_cache_hits_on_the_same_schema(tiny: Any) -> None:
    from mlxcel.engine.grammar.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tiny.tokenizer, cache_size=2)
    first = backend.compile_json_schema(SCHEMA)
    assert backend.compile_json_schema(json.loads(json.dumps(SCHEMA))) is first
    assert backend.compile_json_schema(json.dumps(SCHEMA, indent=2)) is first
    info = backend.cache_info()
    assert (info.hits, info.misses, info.size) == (2, 1, 1)
    reordered = dict(reversed(list(SCHEMA.items())))  # key order is part of the grammar
    assert backend.compile_json_schema(reordered) is not first
    backend.compile_json_schema({"type": "integer"})  # evicts the least recently used
    assert backend.cache_info().size == 2
    assert backend.compile_json_schema(SCHEMA) is not first
    assert backend.cache_info().misses == 4
    a, b = first.matcher(), first.matcher()  # matchers are independent
    assert a.accept(tiny.tokenizer.encode("{", add_special=False)[0])
    assert b.accept(tiny.tokenizer.encode("{", add_special=False)[0])


def test_backend_is_built_once_per_tokenizer(tiny: Any) -> None:
    backend = get_grammar_backend("llguidance", tiny.tokenizer)
    assert get_grammar_backend("llguidance", tiny.tokenizer) is backend
    assert backend.vocab_size == tiny.tokenizer.vocab_size
    assert set(backend.eos_token_ids) == set(tiny.tokenizer.eos_token_ids)


# ----------------------------------------------------------------------- response_format


def test_response_format_rules() -> None:
    schema = {"type": "object"}
    wrapped = {
        "type": "json_schema",
        "json_schema": {"name": "r", "strict": True, "schema": schema},
    }
    assert schema_from_response_format(wrapped) == schema
    assert schema_from_response_format(None) is None
    assert schema_from_response_format({"type": "text"}) is None
    assert schema_from_response_format({}) is None
    # json_object: any object (OpenAI), or the schema beside it (llama-server's extension)
    assert schema_from_response_format({"type": "json_object"}) == {"type": "object"}
    with_schema = {"type": "json_object", "schema": {"const": "42"}}
    assert schema_from_response_format(with_schema) == {"const": "42"}
    for bad in [
        {"type": "json_object", "schema": 123},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "r"}},
        {"type": "json_schema", "json_schema": {"schema": [1]}},
        {"type": "yaml"},
        "json",
    ]:
        with pytest.raises(InvalidRequestError):
            schema_from_response_format(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------ xgrammar schema adaptation


def test_xgrammar_schema_adaptation_without_xgrammar() -> None:
    """The rewrite that keeps xgrammar's output valid JSON (pure Python: runs everywhere)."""
    from mlxcel.engine.grammar.xgrammar_backend import adapt_schema

    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 4},
            "not": {"const": {"maxLength": 3}},  # a property called "not"; data stays as is
        },
        "$defs": {"tag": {"type": "string", "maxLength": 2}},
        "anyOf": [{"type": "object"}],
    }
    adapted = adapt_schema(schema)
    name = adapted["properties"]["name"]
    assert "minLength" not in name and "maxLength" not in name
    assert name["pattern"].startswith("^(") and name["pattern"].endswith("){1,4}$")
    assert adapted["$defs"]["tag"]["pattern"].endswith("){0,2}$")
    assert adapted["properties"]["not"] == {"const": {"maxLength": 3}}
    assert schema["properties"]["name"]["maxLength"] == 4  # the input is not modified
    for refused in (
        {"type": "string", "pattern": "^a+$", "maxLength": 3},
        {"type": "string", "format": "email", "maxLength": 30},
        {"properties": {"a": {"not": {"type": "string"}}}},
        {"items": [{"uniqueItems": True}]},
        {"$ref": "https://example.invalid/schema.json"},
        {"type": "string", "pattern": "(?<=a)b"},
    ):
        with pytest.raises(InvalidSchema):
            adapt_schema(refused)
    assert adapt_schema({"uniqueItems": False, "$ref": "#/$defs/x"}) == {
        "uniqueItems": False,
        "$ref": "#/$defs/x",
    }


def test_gbnf_grammar_reads_as_lark_and_is_bounded() -> None:
    """llama-server's GBNF grammars become llguidance Lark; oversize, deep or broken ones
    are 400-class errors (SchemaTooLarge / InvalidSchema), never a crash."""
    from mlxcel.engine.grammar import InvalidSchema, SchemaTooLarge
    from mlxcel.engine.grammar.gbnf import MAX_GBNF_BYTES, lark_from_gbnf

    assert 'start: "a"{5,5}' in lark_from_gbnf('root ::= "a"{5,5}')
    with pytest.raises(SchemaTooLarge):
        lark_from_gbnf("root ::= " + " | ".join(['"a"'] * (MAX_GBNF_BYTES // 4)))
    for broken in ("root ::= [a-", "root ::= foo", 'start ::= "a"', "root ::= " + "(" * 5000):
        with pytest.raises(InvalidSchema):
            lark_from_gbnf(broken)
