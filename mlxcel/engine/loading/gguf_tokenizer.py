"""Rebuild a Hugging Face fast tokenizer from the tokenizer a GGUF file describes in its metadata.

The vocabulary, merges and special tokens are handed to transformers' GGUF tokenizer builders
(which need no torch), except Gemma's 262k-token SentencePiece vocabularies, whose merges are
listed here in one pass (`gemma_tokenizer`: the same tokenizer, without sorting half a million
merges). The `tokenizers` backend is wrapped as it is built, not deep-copied, so a second
vocabulary never exists. Two things are added so token ids match llama.cpp's:

* pre-tokenizer splits for the `tokenizer.ggml.pre` types transformers does not know (for
  example `smollm`, which splits every digit on its own), and
* llama.cpp's BOS/EOS rules (`add_bos_token`, with its per-type defaults).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_METASPACE = "\u2581"  # SentencePiece's word-boundary mark

# llama.cpp's pre-tokenizer regexes for byte-level (gpt2) vocabularies, applied one after the
# other (each splits the pieces the previous one left). Only the types that transformers'
# GGUF_PRE_TOKENIZER_SPLITS lacks are listed; names are llama.cpp's `tokenizer.ggml.pre` values.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)

EXTRA_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "jina-v1-en",
            "jina-v2-es",
            "jina-v2-de",
            "jina-v2-code",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        (_GPT2_SPLIT,),
    ),
    **dict.fromkeys(
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _DIGITS_THEN_GPT2,
    ),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (r" ?[^(\s|.,!?…。，、।۔،)]+",)),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}

# Pre-tokenizer types that reuse a regex transformers already has under another name.
_PRE_TOKENIZER_ALIASES = {
    "stablelm2": "qwen2",
    "hunyuan": "qwen2",
    "solar-open": "qwen2",
    "glm4": "llama3",
    "chatglm-bpe": "llama3",
}

# Byte-level pre-tokenizer types for which llama.cpp adds BOS when the file does not say.
_BPE_ADDS_BOS = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
        "chameleon",
    }
)


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A `transformers.PreTrainedTokenizerFast` equivalent to llama.cpp's for this metadata.

    `metadata` is a GGUF metadata mapping (`tokenizer.ggml.*`, `general.architecture`, ...);
    values may be Python values, numpy arrays or MLX arrays. The chat template, if any, is set
    as the tokenizer's `chat_template`. Raises ValueError if the file describes no tokenizer or
    one transformers cannot build.
    """
    architecture = str(metadata.get("general.architecture", ""))
    fields = tokenizer_fields(metadata)
    model_type = fields.get("tokenizer_type")
    tokens: list[str] = fields.get("tokens") or []
    if not model_type or not tokens:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")

    backend = backend_tokenizer(architecture, fields)
    pre_type = str(fields.get("pre_tokenizer_type") or "default")
    if model_type == "gpt2":
        _set_byte_level_splits(backend, pre_type)
    elif model_type == "llama":
        _space_after_every_special(backend)

    def token_of(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        index = int(plain(token_id))
        return tokens[index] if 0 <= index < len(tokens) else None

    add_bos = _flag(
        metadata, "tokenizer.ggml.add_bos_token", _adds_bos_by_default(model_type, pre_type)
    )
    add_eos = _flag(metadata, "tokenizer.ggml.add_eos_token", False)
    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    template = metadata.get("tokenizer.chat_template")
    tokenizer = wrap_backend(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token_of("unknown_token_id"),
        pad_token=token_of("padding_token_id"),
        add_bos_token=bool(add_bos and bos is not None),
        add_eos_token=bool(add_eos and eos is not None),
        additional_special_tokens=special_added_tokens(backend),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = str(template) if template else None
    return tokenizer


def tokenizer_fields(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The `tokenizer.*` metadata under the names transformers' GGUF builders take, as plain
    Python values."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    fields: dict[str, Any] = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        value = metadata.get(f"tokenizer.{key}")
        if value is not None:
            fields[name] = plain(value)
    return fields


def backend_tokenizer(architecture: str, fields: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` transformers' GGUF builders make from `fields` (named as in
    `GGUF_TOKENIZER_MAPPING`); where transformers builds a Gemma vocabulary, it is built by
    `gemma_tokenizer` here, with the same special tokens and splits added after."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as builders

    sentencepiece = fields.get("tokenizer_type") == "llama"
    if sentencepiece and builders.GGUF_SENTENCEPIECE_BUILDERS.get(architecture) is (
        builders.gemma_tokenizer
    ):
        tokenizer = builders.add_gguf_special_tokens(gemma_tokenizer(fields["tokens"]), fields)
        return builders.set_split_regex(tokenizer, fields).backend_tokenizer
    backend, _ = builders.convert_gguf_tokenizer(architecture, fields)
    return backend


def gemma_tokenizer(tokens: Sequence[str]) -> Any:
    """transformers' Gemma GGUF builder with its merges listed in one pass.

    As there: tokens of two or more spaces are respelled `▁▁`, and every split of a token into
    two tokens is a merge, ranked by the token's place in the file (its last place, for a
    repeated token) and, within a token, longer left piece first. transformers gets that order
    by sorting each token's splits and then all 515k merges of a 262k vocabulary; walking the
    file in order gives it directly."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    respelled = [_METASPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    merges: list[tuple[str, str]] = []
    for index, token in enumerate(respelled):
        if vocab[token] != index:  # a repeated token ranks at its last place
            continue
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    # pairs, as transformers' own builder passes them (its annotation says strings only)
    return GemmaTokenizer(vocab=vocab, merges=merges)  # type: ignore[arg-type]


def wrap_backend(backend: Any, **options: Any) -> Any:
    """A `PreTrainedTokenizerFast` holding `backend` itself. Its `tokenizer_object=` would
    deep-copy it: a second tokenizer while it is built (100 MB and 2 s for Gemma's 262k
    vocabulary). transformers keeps a backend that is set before its `__init__` runs, as its
    own tokenizer classes do."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    PreTrainedTokenizerFast.__init__(tokenizer, **options)
    return tokenizer


def special_added_tokens(backend: Any) -> list[str]:
    """The backend's special (control) added tokens, in id order, so that transformers lists
    them in `all_special_ids` and `skip_special_tokens` drops them."""
    added = backend.get_added_tokens_decoder()
    return [added[i].content for i in sorted(added) if added[i].special]


def end_of_generation_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """Ids that end a reply: EOS plus the end-of-turn/end-of-message ids the file names."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(plain(value)) not in ids:
            ids.append(int(plain(value)))
    return tuple(ids)


def pre_tokenizer_splits(pre_type: str) -> Sequence[str] | None:
    """The regexes llama.cpp splits text with for a byte-level `tokenizer.ggml.pre` type.

    None when the type is unknown to both this table and transformers' one.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    name = _PRE_TOKENIZER_ALIASES.get(pre_type, pre_type)
    if name in GGUF_PRE_TOKENIZER_SPLITS:
        return (GGUF_PRE_TOKENIZER_SPLITS[name],)
    return EXTRA_PRE_TOKENIZER_SPLITS.get(name)


def _set_byte_level_splits(backend: Any, pre_type: str) -> None:
    from tokenizers import Regex, pre_tokenizers

    splits = pre_tokenizer_splits(pre_type)
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; using GPT-2 splitting", pre_type)
        return
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _space_after_every_special(backend: Any) -> None:
    """SentencePiece: the word-boundary `▁` before the text after every special token too,
    as llama.cpp's tokenizer adds its space prefix to each text fragment that follows one
    (transformers' converter prepends it to the first fragment only). Without it,
    `<s><|start_header_id|>` gave other tokens than llama-server, and `<s>` + text in a
    template other tokens than BOS added to the text."""
    from tokenizers import pre_tokenizers

    pre = backend.pre_tokenizer
    if isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=pre.replacement, prepend_scheme="always", split=pre.split
        )


def _adds_bos_by_default(model_type: str, pre_type: str) -> bool:
    if model_type == "llama":  # SentencePiece: llama.cpp adds BOS unless the file says otherwise
        return True
    return model_type == "gpt2" and pre_type in _BPE_ADDS_BOS


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key)
    return default if value is None else bool(plain(value))


def plain(value: Any) -> Any:
    """A GGUF metadata value as plain Python: arrays become lists, 0-d arrays scalars."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return list(value) if isinstance(value, tuple) else value


_SAVED_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` (with the chat template) that both
    `load_saved_tokenizer` and `transformers.AutoTokenizer` read."""
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(tokenizer.add_bos_token),
        "add_eos_token": bool(tokenizer.add_eos_token),
        "clean_up_tokenization_spaces": False,
        "chat_template": tokenizer.chat_template,
        "additional_special_tokens": special_added_tokens(tokenizer.backend_tokenizer),
    }
    for key in _SAVED_KEYS:
        config[key] = getattr(tokenizer, key)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def load_saved_tokenizer(directory: Path) -> Any:
    """The tokenizer `save_tokenizer` wrote to `directory`."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = wrap_backend(
        read_tokenizer_json(directory / "tokenizer.json"),
        additional_special_tokens=list(config.get("additional_special_tokens") or []),
        add_bos_token=bool(config.get("add_bos_token")),
        add_eos_token=bool(config.get("add_eos_token")),
        clean_up_tokenization_spaces=False,
        **{key: config.get(key) for key in _SAVED_KEYS},
    )
    tokenizer.chat_template = config.get("chat_template")
    return tokenizer


_BPE_OPTIONS = (
    "dropout",
    "unk_token",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "fuse_unk",
    "byte_fallback",
    "ignore_merges",
)


def read_tokenizer_json(path: Path) -> Any:
    """The `tokenizers.Tokenizer` a `tokenizer.json` describes. A BPE model is built from the
    file's vocabulary and merges as Python reads them, then the added tokens are added to it:
    the tokenizer the file holds (it writes back the same JSON), in less memory than
    `Tokenizer.from_file` gives it (Gemma's 262k vocabulary: 72 MiB, not 95, measured by
    bench/gguf_memory.py). Other models, and merges written as `"a b"` strings, are read as
    `from_file` reads them."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    text = path.read_text(encoding="utf-8")
    data = json.loads(text)
    model = data.get("model") or {}
    merges = model.get("merges") or []
    if (
        model.get("type") != "BPE"
        or not all(isinstance(m, list) and len(m) == 2 for m in merges)
        or data.get("truncation") is not None
        or data.get("padding") is not None
    ):
        return Tokenizer.from_str(text)
    del text
    options = {key: model[key] for key in _BPE_OPTIONS if model.get(key) is not None}
    shell = {**data, "added_tokens": [], "model": {"type": "BPE", "vocab": {}, "merges": []}}
    pipeline = Tokenizer.from_str(json.dumps(shell))
    tokenizer = Tokenizer(BPE(vocab=model["vocab"], merges=[(a, b) for a, b in merges], **options))
    del model, merges, data["model"]
    for part in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        setattr(tokenizer, part, getattr(pipeline, part))
    # in the file's order (by id), a run of special or plain tokens at a time: tokens the
    # vocabulary lacks get the ids after it, as the file gives them
    run: list[AddedToken] = []
    for entry in data["added_tokens"]:
        token = AddedToken(
            entry["content"],
            single_word=entry["single_word"],
            lstrip=entry["lstrip"],
            rstrip=entry["rstrip"],
            normalized=entry["normalized"],
            special=entry["special"],
        )
        if run and run[-1].special != token.special:
            _add_tokens(tokenizer, run)
            run = []
        run.append(token)
    _add_tokens(tokenizer, run)
    return tokenizer


def _add_tokens(tokenizer: Any, tokens: list[Any]) -> None:
    if tokens and tokens[0].special:
        tokenizer.add_special_tokens(tokens)
    elif tokens:
        tokenizer.add_tokens(tokens)
