"""Rebuild a Hugging Face fast tokenizer from the tokenizer a GGUF file describes in its metadata.

The vocabulary, merges and special tokens are handed to transformers' GGUF tokenizer builders
(which need no torch). Two things are added so token ids match llama.cpp's:

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
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    architecture = str(metadata.get("general.architecture", ""))
    fields: dict[str, Any] = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        value = metadata.get(f"tokenizer.{key}")
        if value is not None:
            fields[name] = plain(value)
    model_type = fields.get("tokenizer_type")
    tokens: list[str] = list(fields.get("tokens") or [])
    if not model_type or not tokens:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")

    backend, _ = convert_gguf_tokenizer(architecture, fields)
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
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
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
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        additional_special_tokens=list(config.get("additional_special_tokens") or []),
        add_bos_token=bool(config.get("add_bos_token")),
        add_eos_token=bool(config.get("add_eos_token")),
        clean_up_tokenization_spaces=False,
        **{key: config.get(key) for key in _SAVED_KEYS},
    )
    tokenizer.chat_template = config.get("chat_template")
    return tokenizer
