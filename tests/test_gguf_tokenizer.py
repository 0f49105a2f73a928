"""The tokenizer rebuilt from GGUF metadata: ids equal the source tokenizer's and llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.tiny_models import write_tiny_gguf

from mlxcel.engine.loading.gguf import read_gguf_header
from mlxcel.engine.loading.gguf_tokenizer import (
    EXTRA_PRE_TOKENIZER_SPLITS,
    backend_tokenizer,
    build_gguf_tokenizer,
    end_of_generation_ids,
    load_saved_tokenizer,
    read_tokenizer_json,
    save_tokenizer,
    tokenizer_fields,
    wrap_backend,
)

TEXTS = [
    "The capital of France is Paris.",
    "Hello world! 123 and 2024, 1,000,000.5",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "it's we'll they've I'd DON'T",
    "Café déjà vu — naïve 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    '<tool_call>{"name": "f"}</tool_call><|endoftext|>',
    "",
]


def source_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def gguf_metadata(model_dir: Path, out: Path) -> dict[str, Any]:
    return read_gguf_header(write_tiny_gguf(model_dir, out, "Q8_0")).metadata


@pytest.fixture(scope="module")
def llama_metadata(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return gguf_metadata(tiny_llama_dir, tmp_path_factory.mktemp("tok") / "llama.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ids_equal_the_source_tokenizer(
    arch: str, tiny_llama_dir: Path, tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    ours = build_gguf_tokenizer(gguf_metadata(model_dir, tmp_path / "m.gguf"))
    reference = source_tokenizer(model_dir)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special
            ), text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert (ours.encode("hi")[0] == ours.bos_token_id) == (arch == "llama")
    assert ours.chat_template == reference.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_and_added_tokens(llama_metadata: dict) -> None:
    tokenizer = build_gguf_tokenizer(llama_metadata)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<think>")}
    text = "<|im_start|>x<|im_end|><think>"
    assert tokenizer.encode(text, add_special_tokens=False) == [
        ids["<|im_start|>"],
        tokenizer.convert_tokens_to_ids("x"),
        ids["<|im_end|>"],
        ids["<think>"],
    ]
    assert {ids["<|im_start|>"], ids["<|im_end|>"]} <= set(tokenizer.all_special_ids)
    assert ids["<think>"] not in tokenizer.all_special_ids  # user-defined, not control
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == "x<think>"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert len(tokenizer) == len(llama_metadata["tokenizer.ggml.tokens"])


@pytest.mark.parametrize(
    ("pre", "flag", "adds_bos"),
    [
        ("gpt-2", True, True),
        ("gpt-2", False, False),
        ("gpt-2", None, False),  # llama.cpp's default for most byte-level types
        ("llama-bpe", None, True),  # ... but Llama 3 style vocabularies add BOS
    ],
)
def test_bos_rules(llama_metadata: dict, pre: str, flag: bool | None, adds_bos: bool) -> None:
    metadata = {k: v for k, v in llama_metadata.items() if k != "tokenizer.ggml.add_bos_token"}
    metadata["tokenizer.ggml.pre"] = pre
    if flag is not None:
        metadata["tokenizer.ggml.add_bos_token"] = flag
    tokenizer = build_gguf_tokenizer(metadata)
    bos = metadata["tokenizer.ggml.bos_token_id"]
    assert (tokenizer.encode("hello")[0] == bos) == adds_bos
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != bos


def test_sentencepiece_vocabulary() -> None:
    """A `llama` (SentencePiece) vocabulary: BOS unless the file says not, byte fallback."""
    import numpy as np

    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "▁he", "▁hel"]
    words += ["▁hell", "▁hello", "▁w", "▁wo", "or", "▁wor", "▁worl", "▁world"]
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    metadata: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *bytes_, *words],
        "tokenizer.ggml.token_type": np.array([2, 3, 3] + [6] * 256 + [1] * len(words)),
        "tokenizer.ggml.scores": np.array([0.0] * 259 + [-float(i) for i in range(len(words))]),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tokenizer = build_gguf_tokenizer(metadata)
    ids = tokenizer.encode("hello world!")
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "▁hello", "▁world", "<0x21>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world!"
    no_bos = build_gguf_tokenizer({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hello world!") == ids[1:]
    # llama.cpp puts its space prefix before the text after every special token, so a
    # template's `<s>` written as text gives the same tokens as BOS added to the text.
    templated = tokenizer.encode("<s>hello</s>world", add_special_tokens=False)
    pieces = ["<s>", "▁hello", "</s>", "▁world"]
    assert tokenizer.convert_ids_to_tokens(templated) == pieces
    assert tokenizer.encode("hello</s>world") == templated


def test_smollm_pre_tokenizer_splits_digits(llama_metadata: dict, tiny_llama_dir: Path) -> None:
    """`smollm` is not in transformers' table; llama.cpp splits digits one by one for it."""
    from tokenizers import Tokenizer, pre_tokenizers

    reference = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    smollm = build_gguf_tokenizer({**llama_metadata, "tokenizer.ggml.pre": "smollm"})
    gpt2 = build_gguf_tokenizer({**llama_metadata, "tokenizer.ggml.pre": "gpt-2"})
    for text in TEXTS:
        assert smollm.encode(text) == reference.encode(text).ids, text
    pieces = smollm.convert_ids_to_tokens(smollm.encode("in 2024", add_special_tokens=False))
    assert pieces[-4:] == ["2", "0", "2", "4"] and pieces[-5] == "Ġ"
    merged = gpt2.convert_ids_to_tokens(gpt2.encode("in 2024", add_special_tokens=False))
    assert len(merged) < len(pieces)  # the tiny vocabulary does merge digits


def test_every_extra_pre_tokenizer_builds(llama_metadata: dict) -> None:
    text = "Hello, World! 12345 — it's 3.14\n\t  东京"
    for pre in EXTRA_PRE_TOKENIZER_SPLITS:
        tokenizer = build_gguf_tokenizer({**llama_metadata, "tokenizer.ggml.pre": pre})
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text, pre


def test_no_tokenizer_in_file(llama_metadata: dict) -> None:
    metadata = {k: v for k, v in llama_metadata.items() if not k.startswith("tokenizer.")}
    with pytest.raises(ValueError, match="no tokenizer"):
        build_gguf_tokenizer(metadata)


def test_end_of_generation_ids(llama_metadata: dict) -> None:
    eos = llama_metadata["tokenizer.ggml.eos_token_id"]
    assert end_of_generation_ids(llama_metadata) == (eos,)
    with_eot = {**llama_metadata, "tokenizer.ggml.eot_token_id": 1}
    assert end_of_generation_ids(with_eot) == (eos, 1)


def test_saved_tokenizer_round_trip(llama_metadata: dict, tmp_path: Path) -> None:
    original = build_gguf_tokenizer(llama_metadata)
    save_tokenizer(original, tmp_path)
    loaded = load_saved_tokenizer(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == original.encode(text)
    assert loaded.chat_template == original.chat_template
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token"):
        assert getattr(loaded, attr) == getattr(original, attr), attr
    assert loaded.all_special_ids == original.all_special_ids


# ------------------------------------------------------------------------ SmolLM2's file

# Token ids llama.cpp's /tokenize gives for SmolLM2-135M-Instruct (its pre-tokenizer splits
# every digit, as SmolLM2's own tokenizer.json does with Digits(individual_digits=True)).
SMOLLM2_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Hello, we can use": [19556, 28, 392, 416, 722],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "12345": [33, 34, 35, 36, 37],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
    "\n": [198],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    return build_gguf_tokenizer(read_gguf_header(smollm2_gguf).metadata)


def test_smollm2_ids(smollm2_tokenizer: Any) -> None:
    for text, ids in SMOLLM2_IDS.items():
        assert smollm2_tokenizer.encode(text) == ids, text  # the file says: no BOS
        assert smollm2_tokenizer.decode(ids) == text


def test_smollm2_specials_and_template(smollm2_tokenizer: Any) -> None:
    tokenizer = smollm2_tokenizer
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.unk_token == "<|endoftext|>" and len(tokenizer) == 49152
    assert {0, 1, 2, 3} <= set(tokenizer.all_special_ids)  # control tokens, e.g. <repo_name>
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n") and "SmolLM" in prompt
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# ------------------------------------------- built without copies, and read back the same


def gemma_metadata() -> dict[str, Any]:
    """A Gemma-style SentencePiece vocabulary with what its builder respells and ranks: runs
    of spaces stored as spaces (`"  "` collides with `▁▁`), a repeated token, a control token
    and a user-defined one."""
    import numpy as np

    pieces = ["▁", "h", "e", "l", "o", " ", "▁h", "he", "ll", "lo", "▁he", "hell", "▁hell"]
    pieces += ["▁hello", "  ", "▁▁", "   ", "he", "<start_of_turn>", "<b>", "llo", "ello"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256))]
    tokens += pieces
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    types[tokens.index("<start_of_turn>")], types[tokens.index("<b>")] = 3, 4
    return {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types),
        "tokenizer.ggml.scores": np.array([0.0] * len(tokens)),
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
    }


def test_gemma_vocabulary_is_transformers_one() -> None:
    """Gemma's merges listed in one pass give the tokenizer transformers' builder gives:
    the same serialized `tokenizers` JSON (vocabulary, merges in order, added tokens)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    fields = tokenizer_fields(gemma_metadata())
    ours = backend_tokenizer("gemma3", fields)
    reference, _ = convert_gguf_tokenizer("gemma3", fields)
    assert json.loads(ours.to_str()) == json.loads(reference.to_str())
    for text in ["hello  hello   he<b>", "hello<start_of_turn>  x", *TEXTS]:
        assert ours.encode(text).ids == reference.encode(text).ids, text
    assert "▁▁" in ours.encode("hello   hello").tokens  # the respelled run of spaces


def test_wrapper_holds_the_backend_built(llama_metadata: dict) -> None:
    """No deep copy of the backend: the wrapper's is the very tokenizer built from the file."""
    fields = tokenizer_fields(llama_metadata)
    backend = backend_tokenizer("llama", fields)
    tokenizer = wrap_backend(backend, bos_token="<s>", clean_up_tokenization_spaces=False)
    assert tokenizer.backend_tokenizer is backend
    assert tokenizer.encode("hello", add_special_tokens=False) == backend.encode("hello").ids


@pytest.mark.parametrize("kind", ["byte-level", "gemma"])
def test_tokenizer_json_read_back_as_written(
    kind: str, llama_metadata: dict, tmp_path: Path
) -> None:
    """`read_tokenizer_json` (the store's way) gives back the tokenizer `save_tokenizer` wrote,
    added tokens included, one past the vocabulary among them: the same JSON, the same ids.
    Where the vocabulary has no repeated token, that is `Tokenizer.from_file`'s tokenizer;
    with one (Gemma's `"  "` and `▁▁`), `from_file` gives the token past the vocabulary the
    id of the last added token, which it loses."""
    from tokenizers import Tokenizer

    metadata = llama_metadata if kind == "byte-level" else gemma_metadata()
    original = build_gguf_tokenizer(metadata).backend_tokenizer
    original.add_special_tokens(["<past_the_vocabulary>"])
    save_tokenizer(wrap_backend(original, clean_up_tokenization_spaces=False), tmp_path)
    path = tmp_path / "tokenizer.json"
    ours = read_tokenizer_json(path)
    assert json.loads(ours.to_str()) == json.loads(path.read_text())
    past = ours.token_to_id("<past_the_vocabulary>")
    assert past == original.token_to_id("<past_the_vocabulary>") == original.get_vocab_size() - 1
    for text in [*TEXTS, "he<past_the_vocabulary>llo  <b>"]:
        assert ours.encode(text).ids == original.encode(text).ids, text
    if kind == "byte-level":
        assert json.loads(ours.to_str()) == json.loads(Tokenizer.from_file(str(path)).to_str())
