"""GGUF quantized tensors load into MLX quantized layers: each type in its stated layout and
within its stated error of gguf-py's dequantization (docs/models.md), a tiny model with
K-quant tensors decodes as the same model with the dequantized float weights, and
inconsistent files are refused with one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures.gguf_quant_blocks import (
    QUANT_TYPES,
    random_blocks,
    with_tensors_replaced,
    write_tensors_gguf,
)
from fixtures.tiny_models import write_tiny_gguf

from mlxcel.engine.loading import gguf as gguf_loader
from mlxcel.engine.loading.gguf import load_gguf, read_gguf_header

# ggml type -> (MLX bits, the largest |error| / the tensor's largest |value| on the random test
# tensor with float16 scales, as docs/models.md states it); 0: bit for bit
STATED = {
    "Q8_0": (8, 0.0),
    "Q4_0": (4, 0.0),
    "Q4_1": (4, 0.0),
    "Q5_0": (5, 0.0),
    "Q5_1": (5, 0.0),
    "Q4_K": (4, 3e-4),
    "Q5_K": (5, 4e-4),
    "Q6_K": (8, 5e-3),
    "Q3_K": (5, 3e-2),
    "Q2_K": (4, 3e-2),
    "IQ4_NL": (6, 1.5e-2),
    "IQ4_XS": (6, 1.5e-2),
}
ROUNDED = ("Q4_K", "Q5_K")  # exact but for the scale and bias products' rounding
EXACT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
PROMPT = [[0, 17, 301, 5, 88, 260, 412, 3]]


def test_every_type_is_covered() -> None:
    assert set(STATED) == set(QUANT_TYPES)


def dequantized(parts: dict[str, Any], bits: int) -> np.ndarray:
    weight = mx.dequantize(
        parts["weight"],
        parts["scales"].astype(mx.float32),
        parts["biases"].astype(mx.float32),
        group_size=32,
        bits=bits,
    )
    return np.array(weight)


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_each_type_loads_quantized_within_its_stated_error(
    quant: str, dtype: Any, tmp_path: Path
) -> None:
    """Read through the loader's header parser and tensor reader from a file, the tensor is
    an MLX triplet of the stated width: bit for bit, exact but for the float16 rounding of
    each group's scale and bias (Q4_K/Q5_K), or within half a step of its group (the nearest
    layouts), and within the stated error of the tensor's largest value."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(sum(map(ord, quant)))
    raw = random_blocks(quant, 48, 512, rng, largest=4.0)
    path = write_tensors_gguf(tmp_path / f"{quant}.gguf", {"w.weight": (raw, quant)})
    (info,) = read_gguf_header(path).tensors
    assert (info.type_name, info.shape) == (quant, (48, 512))
    with open(path, "rb") as f:
        parts = gguf_loader._from_raw(f, info, dtype, keep_float=False)
    bits, stated = STATED[quant]
    assert parts["weight"].dtype == mx.uint32 and parts["scales"].dtype == dtype
    assert parts["weight"].shape == (48, 512 * bits // 32) and parts["scales"].shape == (48, 16)
    reference = dequantize(raw, GGMLQuantizationType[quant]).astype(np.float32)
    error = np.abs(dequantized(parts, bits) - reference).reshape(48, 16, 32).max(axis=-1)
    if quant in EXACT or (quant in ROUNDED and dtype == mx.float32):
        assert error.max() == 0
        return
    scale = np.abs(np.array(parts["scales"].astype(mx.float32)))
    bias = np.abs(np.array(parts["biases"].astype(mx.float32)))
    # the scale and bias as stored: float16 keeps 11 bits, and steps of 2**-24 below 2**-14
    rounding, tiny = (2.0**-11, 2.0**-25) if dtype == mx.float16 else (2.0**-23, 0.0)
    bound = rounding * (scale * ((1 << bits) - 1) + bias) + tiny * (1 << bits)
    if quant not in ROUNDED:
        bound += scale / 2  # the nearest grid point
    assert np.all(error <= bound * 1.001 + 1e-7)
    if dtype == mx.float16:
        assert 0 < error.max() <= stated * np.abs(reference).max()


def test_mxfp4_loads_bit_for_bit_in_mlx_mxfp4_mode(tmp_path: Path) -> None:
    """MXFP4 blocks (every E2M1 code, every finite E8M0 scale byte, subnormal ones included)
    load as MLX's `mxfp4` pair (E2M1 codes, the scale bytes kept, no biases) whose
    dequantization and quantized matmul are gguf-py's values bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, width = 32, 256
    rng = np.random.default_rng(39)
    blocks = rng.integers(0, 256, size=(rows, width // 32, 17), dtype=np.uint8)
    blocks[..., 0] = np.arange(rows * width // 32).reshape(rows, -1) % 254  # 0..253: finite
    raw = blocks.reshape(rows, -1)
    path = write_tensors_gguf(tmp_path / "mxfp4.gguf", {"w.weight": (raw, "MXFP4")})
    (info,) = read_gguf_header(path).tensors
    with open(path, "rb") as f:
        parts = gguf_loader._from_raw(f, info, mx.float16, keep_float=True)
    assert set(parts) == {"weight", "scales"}
    assert parts["weight"].dtype == mx.uint32 and parts["weight"].shape == (rows, width // 8)
    assert parts["scales"].dtype == mx.uint8 and parts["scales"].shape == (rows, width // 32)
    reference = dequantize(raw, GGMLQuantizationType.MXFP4).astype(np.float32)
    got = mx.dequantize(
        parts["weight"], parts["scales"], group_size=32, bits=4, mode="mxfp4", dtype=mx.float32
    )
    assert np.array_equal(np.array(got), reference)
    moderate = slice(13, 19)  # rows whose scales are 2^-23..2^23: products stay finite
    x = np.random.default_rng(1).standard_normal((3, width)).astype(np.float32)
    product = mx.quantized_matmul(
        mx.array(x),
        parts["weight"][moderate],
        parts["scales"][moderate],
        group_size=32,
        bits=4,
        mode="mxfp4",
    )
    want = x.astype(np.float64) @ reference[moderate].T.astype(np.float64)
    assert np.allclose(np.array(product), want, rtol=1e-5, atol=1e-3)


def test_q6_k_keeps_the_larger_sub_block_exact(tmp_path: Path) -> None:
    """A Q6_K group holds two 16-value sub-blocks: the one with the larger |scale| is on the
    8-bit grid (a quarter of its step), the other within an eighth of that step; every bias
    is -128 times its scale, so the CPU kernel holds the layer in symmetric tiles."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks("Q6_K", 16, 256, np.random.default_rng(6))
    path = write_tensors_gguf(tmp_path / "q6.gguf", {"w.weight": (raw, "Q6_K")})
    (info,) = read_gguf_header(path).tensors
    with open(path, "rb") as f:
        parts = gguf_loader._from_raw(f, info, mx.float32, keep_float=False)
    reference = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(16, 8, 2, 16)
    error = np.abs(dequantized(parts, 8).reshape(16, 8, 2, 16) - reference)
    sc = raw.reshape(16, 210)[:, 192:208].view(np.int8).astype(np.int32).reshape(16, 8, 2)
    larger = np.abs(sc).argmax(axis=-1)
    held = np.take_along_axis(error, larger[..., None, None], axis=2)
    d = raw.reshape(16, 210)[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = np.abs(d) * np.abs(sc).max(axis=-1)
    assert held.max() <= 1e-6 * np.abs(reference).max()
    assert np.all(error.max(axis=(-1, -2)) <= step / 8 * 1.001 + 1e-7)
    assert mx.array_equal(parts["biases"], parts["scales"] * -128.0)


def test_q6_k_float16_biases_are_128_scales_below_the_normal_range(tmp_path: Path) -> None:
    """Stored as float16 (as a file's are), each Q6_K bias is still exactly -128 times its
    scale where the scales are too small for float16's normal range (rounded first, then
    multiplied), so the CPU kernel's symmetric tiles take the layer."""
    from mlxcel.engine.cpu_kernels.layers import symmetric

    raw = random_blocks("Q6_K", 16, 256, np.random.default_rng(7), largest=1e-2)
    path = write_tensors_gguf(tmp_path / "q6.gguf", {"w.weight": (raw, "Q6_K")})
    (info,) = read_gguf_header(path).tensors
    with open(path, "rb") as f:
        parts = gguf_loader._from_raw(f, info, mx.float16, keep_float=False)
    scales = parts["scales"]
    assert scales.dtype == mx.float16
    assert bool(mx.any((scales != 0) & (mx.abs(scales) < 2.0**-14)))  # subnormal ones
    assert symmetric(scales, parts["biases"], 8)


@pytest.fixture(scope="module")
def float_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quant-models") / "tiny-llama.F32.gguf"
    return write_tiny_gguf(tiny_llama_dir, out, "F32")


def greedy(model: Any, steps: int = 8) -> list[int]:
    ids = list(PROMPT[0])
    for _ in range(steps):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(PROMPT[0]) :]


@pytest.mark.parametrize("quant", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_tiny_model_with_k_quant_tensors_decodes_as_its_float_weights(
    quant: str, float_gguf: Path, tmp_path: Path
) -> None:
    """Every `ffn_down` (64 x 256) of the tiny llama as random `quant` blocks: loaded as MLX
    quantized layers it decodes the same greedy tokens as loaded with gguf-py's dequantized
    float weights (`keep_float`) where the layout is exact (Q4_K, Q5_K: the file's float32
    scales hold the products exactly), and close logits where it is the nearest."""
    rng = np.random.default_rng(27)
    tensors = {
        f"blk.{i}.ffn_down.weight": (random_blocks(quant, 64, 256, rng, largest=0.3), quant)
        for i in range(2)
    }
    path = with_tensors_replaced(float_gguf, tmp_path / f"llama.{quant}.gguf", tensors)
    quantized = load_gguf(path).model
    floats = load_gguf(path, keep_float=True).model
    down = quantized.layers[1].mlp.down_proj
    assert hasattr(down, "scales") and down.bits == STATED[quant][0]
    assert not hasattr(floats.layers[1].mlp.down_proj, "scales")
    inputs = mx.array(PROMPT)
    got, want = np.array(quantized(inputs)), np.array(floats(inputs))
    if quant in ROUNDED:
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
        assert greedy(quantized) == greedy(floats)
    else:
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_mxfp4_linear_layers_run_and_dequantize_in_mxfp4_mode(
    float_gguf: Path, tmp_path: Path
) -> None:
    """MXFP4 outside gpt-oss's experts (every `ffn_down` of the tiny llama) loads as an
    `mxfp4` QuantizedLinear whose logits `--cpu-dtype float32`'s dequantization keeps."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from mlxcel.engine.loading import resolve

    rng = np.random.default_rng(4)
    values = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    raw = quantize(values, GGMLQuantizationType.MXFP4)
    tensors = {f"blk.{i}.ffn_down.weight": (raw, "MXFP4") for i in range(2)}
    path = with_tensors_replaced(float_gguf, tmp_path / "llama.MXFP4.gguf", tensors)
    model = load_gguf(path).model
    down = model.layers[1].mlp.down_proj
    assert down.mode == "mxfp4" and down.scales.dtype == mx.uint8
    want = np.array(model(mx.array(PROMPT)))
    resolve._dequantize(model)
    assert type(model.layers[1].mlp.down_proj) is nn.Linear
    got = np.array(model(mx.array(PROMPT)))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_store_entry_of_mixed_widths_loads_the_same_model(float_gguf: Path, tmp_path: Path) -> None:
    """A file mixing 5-bit (Q5_K), 8-bit (Q6_K) and 6-bit (IQ4_NL) layers is saved to the
    model store and read back as the same layers, each with its own width."""
    from mlxcel.engine.loading.store import ModelStore

    rng = np.random.default_rng(5)
    tensors = {
        f"blk.{i}.ffn_down.weight": (random_blocks(quant, 64, 256, rng, largest=0.3), quant)
        for i, quant in enumerate(("Q5_K", "Q6_K"))
    }
    tensors["blk.0.ffn_up.weight"] = (random_blocks("IQ4_NL", 256, 64, rng, largest=0.3), "IQ4_NL")
    path = with_tensors_replaced(float_gguf, tmp_path / "mixed.gguf", tensors)
    store = ModelStore(tmp_path / "store")
    first = load_gguf(path, store=store)
    second = load_gguf(path, store=store)
    assert not first.from_store and second.from_store
    for model in (first.model, second.model):
        layers = model.layers
        mlps = layers[0].mlp, layers[1].mlp
        assert (mlps[0].down_proj.bits, mlps[1].down_proj.bits, mlps[0].up_proj.bits) == (5, 8, 6)
    inputs = mx.array(PROMPT)
    assert mx.array_equal(first.model(inputs), second.model(inputs))


def refused_in_one_line(path: Path, message: str, *, before_listening: bool = True) -> None:
    """`mlxcel generate` exits 2 with one error line; `mlxcel serve` exits 2 with it too,
    before it listens when the header tells (else once its model load fails)."""
    for command in ("generate", "serve"):
        args = [sys.executable, "-m", "mlxcel", command, "-m", str(path)]
        args += ["hi"] if command == "generate" else ["--port", "0"]
        result = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        if command == "serve" and not before_listening:
            assert lines[0].startswith("mlxcel: listening on ")
            lines = lines[1:]
        [line] = lines
        assert line.startswith("mlxcel: error: ") and message in line, line
        assert "Traceback" not in result.stdout + result.stderr


def test_rows_not_whole_blocks_are_refused(tmp_path: Path) -> None:
    """A Q4_K tensor whose rows (300 values) do not split into 256-value blocks."""
    raw = random_blocks("Q4_K", 4, 256, np.random.default_rng(1))
    path = write_tensors_gguf(tmp_path / "odd.gguf", {"odd.weight": (raw, "Q4_K")})
    data = bytearray(path.read_bytes())
    name = b"odd.weight"
    dims = data.index(name) + len(name) + 4  # after the name: n_dims (uint32), then dims
    assert int.from_bytes(data[dims : dims + 8], "little") == 256
    data[dims : dims + 8] = (300).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    message = "tensor odd.weight (Q4_K) has rows of 300 values, not whole 256-value blocks"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf_header(path)
    refused_in_one_line(path, message)


def test_a_tensor_of_another_shape_than_the_hyper_parameters_is_refused(
    float_gguf: Path, tmp_path: Path
) -> None:
    raw = random_blocks("Q5_K", 64, 512, np.random.default_rng(2))
    path = with_tensors_replaced(
        float_gguf, tmp_path / "wide.gguf", {"blk.0.ffn_down.weight": (raw, "Q5_K")}
    )
    message = "down_proj.weight has shape (64, 512), but the file's hyper-parameters give (64, 256)"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_gguf(path)
    # the header is sound: serve finds the mismatch when it loads the weights, past listening
    refused_in_one_line(path, message, before_listening=False)


def test_k_quant_data_past_the_end_is_refused(float_gguf: Path, tmp_path: Path) -> None:
    raw = random_blocks("Q6_K", 64, 256, np.random.default_rng(3))
    whole = with_tensors_replaced(
        float_gguf, tmp_path / "whole.gguf", {"blk.1.ffn_down.weight": (raw, "Q6_K")}
    )
    data = whole.read_bytes()
    (last,) = [t for t in read_gguf_header(whole).tensors if t.offset + t.nbytes == len(data)]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: last.offset + last.nbytes // 2])
    refused_in_one_line(path, "truncated or corrupt GGUF: the file has")


@pytest.mark.parametrize("quant", ["Q8_0", "IQ4_NL"])
def test_stacked_expert_tensors_stay_quantized(quant: str, tmp_path: Path) -> None:
    """llama.cpp's 3-D expert tensors (experts x rows x values) load as quantized switch
    layers, exact (Q8_0) or within the nearest layout's error (IQ4_NL, 6-bit) of the same
    model written with gguf-py's dequantization of them as F32."""
    from fixtures.tiny_arch_gguf import ARCHITECTURES, write_tiny_arch_gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path, _ = write_tiny_arch_gguf(ARCHITECTURES["qwen3moe"], tmp_path / "moe.gguf")
    rng = np.random.default_rng(3)
    blocks, floats = {}, {}
    for info in read_gguf_header(path).tensors:
        if "_exps." in info.name:
            raw = random_blocks(quant, info.rows, info.shape[-1], rng, largest=0.2)
            values = dequantize(raw, GGMLQuantizationType[quant]).astype(np.float32)
            blocks[info.name] = (raw.reshape(*info.shape[:-1], -1), quant)
            floats[info.name] = (values.reshape(info.shape), "F32")
    assert len(blocks) == 6
    quantized = load_gguf(with_tensors_replaced(path, tmp_path / "q.gguf", blocks)).model
    reference = load_gguf(with_tensors_replaced(path, tmp_path / "f.gguf", floats)).model
    experts = quantized.layers[0].mlp.switch_mlp.down_proj
    assert type(experts).__name__ == "QuantizedSwitchLinear"
    assert experts.bits == STATED[quant][0]
    assert not hasattr(reference.layers[0].mlp.switch_mlp.down_proj, "scales")
    inputs = mx.array(PROMPT)
    got, want = np.array(quantized(inputs)), np.array(reference(inputs))
    tolerance = 1e-5 if quant == "Q8_0" else 1e-2
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
    if quant == "Q8_0":
        assert greedy(quantized) == greedy(reference)
