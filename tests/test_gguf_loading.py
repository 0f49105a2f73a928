"""GGUF → MLX loading: logits match the source model, every tensor type, the model store."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from fixtures.tiny_models import (
    QUANT_TYPES,
    build_tiny_model,
    encode_tensor,
    quantize_q4_k,
    quantize_q6_k,
    write_tiny_gguf,
)

from mlxcel.engine.loading import gguf as gguf_loader
from mlxcel.engine.loading import store as store_module
from mlxcel.engine.loading.gguf import GGUFModel, load_gguf, read_gguf_header
from mlxcel.engine.loading.store import ModelStore

IDS = [[0, 17, 301, 5, 88, 260, 412, 3, 99, 511, 42, 7]]

# Relative RMS error of the logits against the source weights after the same GGUF rounding.
# Types mx.load/our repacking decode exactly only see float16 compute error; the others are
# re-quantized by MLX at two bits more than the source type.
TOLERANCE = {
    "F16": 5e-3,
    "BF16": 5e-3,
    "Q8_0": 5e-3,
    "Q4_0": 5e-3,
    "Q4_1": 5e-3,
    "Q5_0": 5e-3,
    "Q5_1": 5e-3,
    "Q4_K": 5e-3,
    "Q6_K": 3e-2,
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-variants")


def source_model(model_dir: Path) -> Any:
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir)
    return model


def logits(model: Any) -> np.ndarray:
    return np.array(model(mx.array(IDS)).astype(mx.float32))


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def rounded_reference(model_dir: Path, quant: str) -> np.ndarray:
    """Logits of the source model with each weight rounded as the GGUF stores it."""
    from gguf.quants import dequantize
    from mlx.utils import tree_flatten

    model = source_model(model_dir)
    rounded = []
    params: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, value in params:
        data, qtype = encode_tensor(np.array(value), quant)
        back = dequantize(data, qtype).reshape(value.shape) if data.dtype == np.uint8 else data
        rounded.append((name, mx.array(np.asarray(back, dtype=np.float32))))
    model.load_weights(rounded)
    return logits(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_matches_the_source_model(
    arch: str, tiny_llama_dir: Path, tiny_qwen3_dir: Path, gguf_dir: Path
) -> None:
    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}.get(arch)
    if model_dir is None:
        model_dir = build_tiny_model(gguf_dir / f"tiny-{arch}", arch)
    loaded = load_gguf(write_tiny_gguf(model_dir, gguf_dir / f"{arch}.F32.gguf", "F32"))
    assert np.abs(logits(loaded.model) - logits(source_model(model_dir))).max() < 1e-4
    source_config = json.loads((model_dir / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert loaded.config[key] == source_config[key]
    assert loaded.config["tie_word_embeddings"] == source_config["tie_word_embeddings"]
    assert (loaded.architecture, loaded.quantization) == (arch, "F32")
    assert loaded.context_length == source_config["max_position_embeddings"]


def test_llama_qk_rows_are_permuted_back(tiny_llama_dir: Path, gguf_dir: Path) -> None:
    path = write_tiny_gguf(tiny_llama_dir, gguf_dir / "llama.F32.perm.gguf", "F32")
    source = source_model(tiny_llama_dir).model.layers[0].self_attn
    stored = mx.load(str(path))
    assert isinstance(stored, dict)
    for part, gguf_name in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
        expected = getattr(source, part).weight
        assert not mx.array_equal(stored[f"blk.0.{gguf_name}.weight"], expected)  # permuted
        loaded = load_gguf(path).model.layers[0].self_attn
        assert mx.array_equal(getattr(loaded, part).weight, expected)


@pytest.mark.parametrize("quant", [q for q in QUANT_TYPES if q != "F32"])
def test_quantized_gguf_logits(quant: str, tiny_llama_dir: Path, gguf_dir: Path) -> None:
    path = write_tiny_gguf(tiny_llama_dir, gguf_dir / f"llama.{quant}.gguf", quant)
    loaded = load_gguf(path)
    got = logits(loaded.model)
    assert relative_error(got, rounded_reference(tiny_llama_dir, quant)) < TOLERANCE[quant]
    # and still close to the unrounded model: the argmax mostly agrees
    agree = np.mean(got.argmax(-1) == logits(source_model(tiny_llama_dir)).argmax(-1))
    assert agree >= (0.5 if quant.startswith("Q4") else 0.9)
    assert loaded.quantization == {"Q4_K": "Q4_K_S"}.get(quant, quant)


def dequantized(layer: Any) -> np.ndarray:
    if hasattr(layer, "scales"):
        bits = layer.weight.shape[-1] * 32 // (layer.scales.shape[-1] * 32)
        weight = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=32, bits=bits)
        return np.array(weight.astype(mx.float32))
    return np.array(layer.weight.astype(mx.float32))


@pytest.mark.parametrize("quant", ["Q4_K", "Q6_K"])
def test_k_quants_decode_like_the_reference(
    quant: str, tiny_llama_dir: Path, gguf_dir: Path
) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = write_tiny_gguf(tiny_llama_dir, gguf_dir / f"llama.{quant}.ref.gguf", quant)
    source = np.array(source_model(tiny_llama_dir).model.layers[1].mlp.down_proj.weight)
    encode = quantize_q4_k if quant == "Q4_K" else quantize_q6_k
    reference = dequantize(encode(source), GGMLQuantizationType[quant])
    # Q4_K is repacked (its scale products rounded once to float16); Q6_K re-quantized at
    # 2 more bits, where the added rounding is about a quarter of the original's
    requantized = 2e-3 if quant == "Q4_K" else 0.05
    for keep_float, tolerance in ((False, requantized), (True, 2e-3)):
        down = load_gguf(path, keep_float=keep_float).model.layers[1].mlp.down_proj
        assert hasattr(down, "scales") != keep_float
        assert relative_error(dequantized(down), reference) < tolerance


@pytest.mark.parametrize("quant", ["Q5_0", "Q5_1", "Q4_K"])
def test_repacked_quants_hold_the_files_values(
    quant: str, tiny_llama_dir: Path, gguf_dir: Path
) -> None:
    """Q5_0/Q5_1/Q4_K tensors load as MLX quantized layers (5- and 4-bit groups of 32, no
    float copy, no re-quantization) holding gguf-py's dequantized values: exactly for Q5_x,
    and for Q4_K within the float16 rounding of each sub-block's scale d*sc and offset
    dmin*m (|error| <= 2**-11 * (|d*sc*q| + |dmin*m|), under 1e-3 of the largest weight)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = write_tiny_gguf(tiny_llama_dir, gguf_dir / f"llama.{quant}.repack.gguf", quant)
    header = read_gguf_header(path)
    (info,) = [t for t in header.tensors if t.name == "blk.1.ffn_down.weight"]
    assert info.type_name == quant
    with open(path, "rb") as f:
        f.seek(info.offset)
        raw = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
    reference = dequantize(raw.reshape(info.shape[0], -1), GGMLQuantizationType[quant])
    down = load_gguf(path).model.layers[1].mlp.down_proj
    assert hasattr(down, "scales") and down.group_size == 32
    assert down.bits == (4 if quant == "Q4_K" else 5)
    error = np.abs(dequantized(down) - reference).max()
    if quant == "Q4_K":
        assert 0 < error < 1e-3 * np.abs(reference).max()
    else:
        assert error == 0


def test_raw_reading_equals_mx_load(tiny_llama_dir: Path, gguf_dir: Path) -> None:
    """Both ways of reading Q4_0/Q4_1/Q8_0 give the same MLX triplets, bit for bit."""
    for quant in ("Q8_0", "Q4_0", "Q4_1"):
        path = write_tiny_gguf(tiny_llama_dir, gguf_dir / f"llama.{quant}.raw.gguf", quant)
        header = read_gguf_header(path)
        native = mx.load(str(path))
        assert isinstance(native, dict)
        with open(path, "rb") as f:
            for info in header.tensors:
                if info.type_name != quant:
                    continue
                ours = gguf_loader._from_raw(f, info, mx.float16, keep_float=False)
                theirs = gguf_loader._from_native(native, info)
                assert ours.keys() == theirs.keys() == {"weight", "scales", "biases"}
                assert all(mx.array_equal(ours[k], theirs[k]) for k in ours)


def test_llama3_rope_factors(gguf_dir: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    model_dir = build_tiny_model(gguf_dir / "tiny-llama3", "llama", rope_scaling=scaling)
    path = write_tiny_gguf(model_dir, gguf_dir / "llama3.F32.gguf", "F32")
    assert any(t.name == "rope_freqs.weight" for t in read_gguf_header(path).tensors)
    expected = logits(source_model(model_dir))
    store = ModelStore(gguf_dir / "store-llama3")
    for _ in range(2):  # converted, then from the store
        loaded = load_gguf(path, store=store)
        assert np.abs(logits(loaded.model) - expected).max() < 1e-4
    assert loaded.from_store


def test_generation_state(tiny_gguf: Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    loaded = load_gguf(tiny_gguf)
    cache = make_prompt_cache(loaded.model)
    assert len(cache) == len(loaded.model.layers) == 2
    step = loaded.model(mx.array([[0, 5, 9]]), cache=cache)
    assert step.shape == (1, 3, loaded.config["vocab_size"])
    assert loaded.eos_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
    assert loaded.metadata["general.architecture"] == "llama"
    assert all(not isinstance(v, (list, np.ndarray)) for v in loaded.metadata.values())


# --------------------------------------------------------------------------------- errors


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(path)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")


def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"truncated or corrupt GGUF: the header is cut off"):
        load_gguf(path)


def test_gguf_cut_in_its_tensor_data_names_what_is_missing(tiny_gguf: Path, tmp_path: Path) -> None:
    """`head -c N model.gguf > t.gguf`: the header is whole, the tensor data is not."""
    import subprocess
    import sys

    data = tiny_gguf.read_bytes()
    path = tmp_path / "half.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as excinfo:
        load_gguf(path)
    message = str(excinfo.value)
    assert message.startswith("truncated or corrupt GGUF: ")
    assert f"has {len(data) // 2} bytes" in message and "tensors are cut off" in message
    assert "reshape" not in message
    for command in ("generate", "serve"):
        args = [sys.executable, "-m", "mlxcel", command, "-m", str(path)]
        args += ["hi"] if command == "generate" else ["--port", "0"]
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("mlxcel: error: ") and "half.gguf" in line
        assert line.count("half.gguf") == 1 and "truncated or corrupt GGUF" in line


def test_unsupported_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = "llama, qwen2, qwen3, gemma3, gemma2, phi3, qwen2moe, qwen3moe, olmo2, granite"
    with pytest.raises(
        ValueError,
        match=rf"'rwkv7'; supported: {supported}, granitemoe, smollm3, gpt-oss, mistral3$",
    ):
        load_gguf(path)


# ---------------------------------------------------------------------------------- store


def test_store_caches_the_converted_model(tiny_gguf: Path, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    first = load_gguf(tiny_gguf, store=store)
    assert not first.from_store and first.store_path is not None
    (entry,) = store.entries()
    assert entry.path == first.store_path and entry.source == str(tiny_gguf.resolve())
    assert entry.quantization == "Q8_0" and entry.size_bytes > tiny_gguf.stat().st_size // 2
    assert {"config.json", "model.safetensors", "tokenizer.json", "mlxcel.json"} <= {
        p.name for p in entry.path.iterdir()
    }
    second = load_gguf(tiny_gguf, store=store)
    assert second.from_store and second.store_path == first.store_path
    assert mx.array_equal(first.model(mx.array(IDS)), second.model(mx.array(IDS)))
    assert_same_load(first, second)

    # the key is the content: a renamed copy hits the same entry
    copy = tmp_path / "renamed.gguf"
    shutil.copy(tiny_gguf, copy)
    assert load_gguf(copy, store=store).store_path == first.store_path

    store.remove(entry.name)
    assert store.entries() == []
    with pytest.raises(KeyError):
        store.remove(entry.name)


def assert_same_load(first: GGUFModel, second: GGUFModel) -> None:
    text = "<|im_start|>user\nThe capital of France is 2024<|im_end|>\n<think>"
    assert first.tokenizer.encode(text) == second.tokenizer.encode(text)
    assert second.chat_template == first.chat_template
    for attr in ("architecture", "context_length", "config", "quantization", "metadata"):
        assert getattr(second, attr) == getattr(first, attr), attr
    assert second.eos_token_ids == first.eos_token_ids
    assert (second.tokenizer.bos_token, second.tokenizer.eos_token) == (
        first.tokenizer.bos_token,
        first.tokenizer.eos_token,
    )


def test_converted_entry_loads_with_mlx_lm(tiny_gguf: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    loaded = load_gguf(tiny_gguf, store=ModelStore(tmp_path / "store"))
    model, tokenizer = load(str(loaded.store_path))  # type: ignore[misc]
    assert relative_error(logits(model), logits(loaded.model)) < 5e-3  # float16 vs float32
    assert tokenizer.encode("hello there") == loaded.tokenizer.encode("hello there")


def test_broken_store_entry_is_converted_again(tiny_gguf: Path, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "store")
    first = load_gguf(tiny_gguf, store=store)
    assert first.store_path is not None
    (first.store_path / "model.safetensors").unlink()
    again = load_gguf(tiny_gguf, store=store)
    assert not again.from_store
    assert load_gguf(tiny_gguf, store=store).from_store
    # an entry written by another version of the conversion is redone too
    assert again.store_path is not None
    manifest_path = again.store_path / "mlxcel.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "conversion": 0}))
    assert not load_gguf(tiny_gguf, store=store).from_store
    assert len(store.entries()) == 1


def test_unwritable_store_still_loads(tiny_gguf: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the store should be")
    loaded = load_gguf(tiny_gguf, store=ModelStore(blocked))
    assert loaded.store_path is None and not loaded.from_store
    assert loaded.model(mx.array(IDS)).shape == (1, len(IDS[0]), loaded.config["vocab_size"])


def test_file_hash_is_memoized(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "m.gguf"
    shutil.copy(tiny_gguf, copy)
    store = ModelStore(tmp_path / "store")
    digest = store.file_hash(copy)
    assert digest == store_module.sha256_file(copy)

    def fail(path: Path) -> str:
        raise AssertionError("hashed again")

    monkeypatch.setattr(store_module, "sha256_file", fail)
    assert ModelStore(tmp_path / "store").file_hash(copy) == digest
    with copy.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(AssertionError, match="hashed again"):
        store.file_hash(copy)


def test_default_store_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLXCEL_MODEL_STORE", str(tmp_path / "elsewhere"))
    assert ModelStore.default().root == tmp_path / "elsewhere"
    monkeypatch.delenv("MLXCEL_MODEL_STORE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ModelStore.default().root == tmp_path / ".cache" / "mlxcel" / "models"
    assert ModelStore(tmp_path / "none").entries() == []


# ----------------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def smollm2_loads(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[GGUFModel, float, GGUFModel, float]:
    import transformers.integrations.gguf.gguf_tokenizer_mapping  # noqa: F401  (import cost)

    store = ModelStore(tmp_path_factory.mktemp("smollm2-store"))
    start = time.perf_counter()
    first = load_gguf(smollm2_gguf, store=store)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = load_gguf(smollm2_gguf, store=store)
    return first, first_s, second, time.perf_counter() - start


@pytest.mark.slow
def test_smollm2_second_load_comes_from_the_store(
    smollm2_loads: tuple[GGUFModel, float, GGUFModel, float],
) -> None:
    """The second load reads the store, not the GGUF file, and gives the same model (how much
    faster that is is bench/ work, not a timed assertion)."""
    first, _, second, _ = smollm2_loads
    assert not first.from_store and second.from_store
    assert_same_load(first, second)
    assert (first.architecture, first.quantization, first.context_length) == ("llama", "Q4_1", 8192)


@pytest.mark.slow
def test_smollm2_greedy_says_paris(
    smollm2_loads: tuple[GGUFModel, float, GGUFModel, float],
) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    for loaded in (smollm2_loads[0], smollm2_loads[2]):  # converted, and from the store
        ids = loaded.tokenizer.encode("The capital of France is")
        cache = make_prompt_cache(loaded.model)
        tokens = mx.array([ids])
        out: list[int] = []
        for _ in range(3):
            token = mx.argmax(loaded.model(tokens, cache=cache)[0, -1]).item()
            assert isinstance(token, int)
            out.append(token)
            tokens = mx.array([[token]])
        assert "Paris" in loaded.tokenizer.decode(out)
