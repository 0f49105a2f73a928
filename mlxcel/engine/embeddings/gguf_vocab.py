"""The tokenizer of a GGUF encoder, rebuilt from its `tokenizer.ggml.*` metadata.

llama.cpp stores a BERT WordPiece vocabulary (`tokenizer.ggml.model = "bert"`) in
"phantom space" form: a token that starts a word gains a leading U+2581, a `##` continuation
loses its `##`, and control tokens ([CLS], [SEP], ...) stay as written. Undoing that gives the
original WordPiece vocabulary, which is run with BERT's normalizer (lower case, accents
stripped, CJK characters split) and pre-tokenizer, as llama.cpp's WPM tokenizer does.

A `t5` vocabulary (the SentencePiece Unigram one llama.cpp writes for XLM-RoBERTa models such
as bge-reranker) is rebuilt from its tokens and scores, normalized with the file's
precompiled character map. Other vocabularies (`gpt2`: RoBERTa's byte-level BPE) go through
the text loader's GGUF tokenizer builder.

Sequences are `CLS A SEP` and, for a cross-encoder, `CLS A SEP B SEP` (with `EOS` after each
part when the file asks for it), the second part typed 1 when the model has two token types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlxcel.engine.errors import ModelLoadError

PHANTOM_SPACE = "\u2581"
CONTROL = 3  # llama.cpp token type of control (special) tokens
_KEY = "tokenizer.ggml."


def _plain(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


def _token_id(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(_KEY + key)
    return None if value is None else int(_plain(value))


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(_KEY + key)
    return default if value is None else bool(_plain(value))


def wordpiece_vocab(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """The original WordPiece vocabulary (`##` continuations) of a phantom-space token list."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        kind = types[index] if index < len(types) else 1
        if kind == CONTROL:
            original = token
        elif token.startswith(PHANTOM_SPACE):
            original = token[len(PHANTOM_SPACE) :]
        else:
            original = "##" + token
        vocab.setdefault(original, index)
    return vocab


def _special(tokens: Sequence[str], *ids: int | None) -> tuple[str, int] | None:
    for token_id in ids:
        if token_id is not None and 0 <= token_id < len(tokens):
            return tokens[token_id], token_id
    return None


def _wordpiece_backend(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], name: str
) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    vocab = wordpiece_vocab(tokens, types)
    unk = _special(tokens, _token_id(metadata, "unknown_token_id"), vocab.get("[UNK]"))
    if unk is None:
        raise ModelLoadError(f"{name}: the WordPiece vocabulary has no unknown token")
    backend = Tokenizer(WordPiece(vocab, unk_token=unk[0], continuing_subword_prefix="##"))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    controls = [t for t, kind in zip(tokens, types, strict=False) if kind == CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    return backend


def _template(metadata: Mapping[str, Any], tokens: list[str], wordpiece: bool, typed: bool) -> Any:
    """`FIRST A END` / `FIRST A END [SEP] B END` from llama.cpp's special-token flags.

    FIRST is CLS (else BOS), END is EOS when the file adds one, else SEP. A WordPiece pair is
    `[CLS] A [SEP] B [SEP]`; other vocabularies repeat the separator between the parts
    (XLM-R's `<s> A </s></s> B </s>`).
    """
    from tokenizers import processors

    vocab = {t: i for i, t in enumerate(tokens)}
    first = _special(
        tokens,
        _token_id(metadata, "cls_token_id"),
        _token_id(metadata, "bos_token_id"),
        vocab.get("[CLS]"),
    )
    sep = _special(
        tokens,
        _token_id(metadata, "seperator_token_id"),
        _token_id(metadata, "eos_token_id"),
        vocab.get("[SEP]"),
    )
    eos = _special(tokens, _token_id(metadata, "eos_token_id"))
    if not _flag(metadata, "add_bos_token", True):
        first = None
    end: tuple[str, int] | None = None
    if eos is not None and _flag(metadata, "add_eos_token", not wordpiece):
        end = eos
    else:
        end = sep if _flag(metadata, "add_sep_token", True) else None
    used = [t for t in (first, end, sep) if t is not None]
    head = [first[0]] if first else []
    tail = [end[0]] if end else []
    middle = tail + ([sep[0]] if sep and not wordpiece else [])
    mark = ":1" if typed else ""
    pair = [*head, "$A", *middle, f"$B{mark}", *(f"{t}{mark}" for t in tail)]
    return processors.TemplateProcessing(
        single=" ".join([*head, "$A", *tail]),
        pair=" ".join(pair),
        special_tokens=sorted(set(used), key=lambda t: t[1]),
    )


def _unigram_normalizer(metadata: Mapping[str, Any]) -> Any:
    """llama.cpp's UGM normalization: the file's precompiled character map, then runs of
    spaces collapsed (unless `remove_extra_whitespaces` is false)."""
    from tokenizers import Regex, normalizers

    steps: list[Any] = []
    charsmap = metadata.get(_KEY + "precompiled_charsmap")
    if charsmap is not None and len(charsmap):
        steps.append(normalizers.Precompiled(bytes(bytearray(_plain(charsmap)))))
    if _flag(metadata, "remove_extra_whitespaces", True):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    return normalizers.Sequence(steps)


def _unigram_backend(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], name: str
) -> Any:
    """A SentencePiece Unigram tokenizer (llama.cpp's UGM) from tokens and scores."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import Unigram

    scores = metadata.get(_KEY + "scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{name}: the Unigram vocabulary has no score for every token")
    unk = _token_id(metadata, "unknown_token_id")
    if unk is None:
        unk = next((i for i, kind in enumerate(types) if kind == 2), None)  # UNKNOWN
    pairs = [(t, float(x)) for t, x in zip(tokens, _plain(scores), strict=True)]
    backend = Tokenizer(Unigram(pairs, unk_id=unk, byte_fallback=False))
    backend.normalizer = _unigram_normalizer(metadata)
    scheme = "always" if _flag(metadata, "add_space_prefix", True) else "never"
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement=PHANTOM_SPACE, prepend_scheme=scheme),
        ]
    )
    backend.decoder = decoders.Metaspace(replacement=PHANTOM_SPACE, prepend_scheme=scheme)
    controls = [t for t, kind in zip(tokens, types, strict=False) if kind == CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    return backend


def gguf_encoder_tokenizer(metadata: Mapping[str, Any], *, name: str, typed: bool) -> Any:
    """A `tokenizers.Tokenizer` for the vocabulary a GGUF encoder file describes.

    `typed`: the model has two token types, so the second part of a pair is typed 1.
    """
    model = str(_plain(metadata.get(_KEY + "model", "")) or "")
    tokens = [str(t) for t in (metadata.get(_KEY + "tokens") or [])]
    if not model or not tokens:
        raise ModelLoadError(f"{name}: the GGUF file has no tokenizer (tokenizer.ggml.* missing)")
    raw_types = metadata.get(_KEY + "token_type")
    types = [int(t) for t in _plain(raw_types)] if raw_types is not None else []
    if model == "bert":
        backend = _wordpiece_backend(metadata, tokens, types, name)
    elif model == "t5":
        backend = _unigram_backend(metadata, tokens, types, name)
    else:
        from mlxcel.engine.loading.gguf_tokenizer import build_gguf_tokenizer

        try:
            backend = build_gguf_tokenizer(metadata).backend_tokenizer
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(
                f"{name}: cannot rebuild the GGUF tokenizer {model!r} ({exc})"
            ) from exc
    backend.post_processor = _template(metadata, tokens, model == "bert", typed)
    return backend
