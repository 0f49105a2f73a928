"""CTranslate2 (faster-whisper) Whisper checkpoints → mlx-whisper's layout.

A CTranslate2 model directory holds `model.bin` (one binary file of named tensors), a
`config.json` (alignment heads, suppressed tokens) and tokenizer files. `read_model_bin`
parses the binary format; `convert_whisper` maps its tensors onto mlx-whisper's module
names: the fused query/key/value projections are split (the key has no bias), convolutions go
from (out, in, kernel) to MLX's (out, kernel, in), int8/int16 weights are dequantized with
their scales, and the alignment heads travel as an `alignment_heads` tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import numpy as np

MODEL_FILE = "model.bin"
WHISPER_SPEC = "WhisperSpec"

# CTranslate2's DataType ids; bfloat16 is widened by hand (numpy has no bfloat16).
_DTYPES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}


@dataclass
class CT2Model:
    """The tensors of a CTranslate2 `model.bin` (aliases resolved) and its spec name."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]


def is_ct2_dir(path: Path) -> bool:
    """Whether `path` looks like a CTranslate2 model directory."""
    return (path / MODEL_FILE).is_file()


def read_model_bin(path: Path) -> CT2Model:
    """Parse a CTranslate2 `model.bin` (binary format version 4 and later)."""

    data = memoryview(Path(path).read_bytes())
    reader = _Reader(data, path.name)
    version = reader.unpack("I")
    if version < 4:
        raise ModelLoadError(
            f"{path.name}: CTranslate2 format version {version} is too old; "
            "convert the model again with a recent ct2-transformers-converter"
        )
    spec = reader.string()
    revision = reader.unpack("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        rank = reader.unpack("B")
        shape = tuple(reader.unpack("I") for _ in range(rank))
        type_id = reader.unpack("B")
        size = reader.unpack("I")
        raw = reader.take(size)
        dtype = _DTYPES.get(type_id)
        if dtype is None:
            raise ModelLoadError(f"{path.name}: tensor {name} has unknown data type {type_id}")
        variables[name] = _to_array(raw, dtype, shape)
    if reader.remaining() >= 4:
        for _ in range(reader.unpack("I")):
            alias = reader.string()
            target = reader.string()
            if target in variables:
                variables[alias] = variables[target]
    return CT2Model(spec=spec, revision=revision, variables=variables)


def convert_whisper(source: Path, out_dir: Path) -> dict[str, Any]:
    """Write mlx-whisper's `config.json` + `weights.safetensors` for the CTranslate2 Whisper
    model in `source` into `out_dir`; returns the model dimensions written."""
    import mlx.core as mx
    import numpy as np

    ct2 = read_model_bin(source / MODEL_FILE)
    if ct2.spec != WHISPER_SPEC:
        raise ModelLoadError(f"{source.name}: a CTranslate2 {ct2.spec} model, not Whisper")
    weights = map_whisper_weights(ct2.variables)
    dims = whisper_dimensions(ct2.variables)
    heads = _alignment_heads(source, dims)
    if heads is not None:
        weights["alignment_heads"] = heads
    out_dir.mkdir(parents=True, exist_ok=True)
    arrays = {name: mx.array(np.ascontiguousarray(value)) for name, value in weights.items()}
    mx.save_safetensors(str(out_dir / "weights.safetensors"), arrays)
    (out_dir / "config.json").write_text(json.dumps({**dims, "model_type": "whisper"}, indent=1))
    return dims


def whisper_dimensions(variables: dict[str, np.ndarray]) -> dict[str, int]:
    """mlx-whisper's `ModelDimensions` read off the tensor shapes."""
    try:
        conv1 = variables["encoder/conv1/weight"]
        embeddings = variables["decoder/embeddings/weight"]
        return {
            "n_mels": int(conv1.shape[1]),
            "n_audio_ctx": int(variables["encoder/position_encodings/encodings"].shape[0]),
            "n_audio_state": int(conv1.shape[0]),
            "n_audio_head": _scalar(variables["encoder/num_heads"]),
            "n_audio_layer": _count_layers(variables, "encoder"),
            "n_vocab": int(embeddings.shape[0]),
            "n_text_ctx": int(variables["decoder/position_encodings/encodings"].shape[0]),
            "n_text_state": int(embeddings.shape[1]),
            "n_text_head": _scalar(variables["decoder/num_heads"]),
            "n_text_layer": _count_layers(variables, "decoder"),
        }
    except KeyError as exc:
        raise ModelLoadError(f"not a Whisper CTranslate2 model (no tensor {exc})") from None


def map_whisper_weights(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """CTranslate2 Whisper tensors under mlx-whisper's parameter names."""
    get = _Getter(variables)
    out: dict[str, np.ndarray] = {}
    for index in (1, 2):
        weight = get.weight(f"encoder/conv{index}")
        out[f"encoder.conv{index}.weight"] = weight.transpose(0, 2, 1)  # (out, kernel, in)
        out[f"encoder.conv{index}.bias"] = get.tensor(f"encoder/conv{index}/bias")
    for side in ("encoder", "decoder"):
        for layer in range(_count_layers(variables, side)):
            src, dst = f"{side}/layer_{layer}", f"{side}.blocks.{layer}"
            _norm(out, get, f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            query, key, value = _split(get, f"{src}/self_attention/linear_0", 3)
            _attention(out, f"{dst}.attn", query, key, value)
            _linear(out, get, f"{dst}.attn.out", f"{src}/self_attention/linear_1")
            if side == "decoder":
                _norm(out, get, f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
                query = (
                    get.weight(f"{src}/attention/linear_0"),
                    get.bias(f"{src}/attention/linear_0"),
                )
                key, value = _split(get, f"{src}/attention/linear_1", 2)
                _attention(out, f"{dst}.cross_attn", query, key, value)
                _linear(out, get, f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
            _norm(out, get, f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")
            _linear(out, get, f"{dst}.mlp1", f"{src}/ffn/linear_0")
            _linear(out, get, f"{dst}.mlp2", f"{src}/ffn/linear_1")
    _norm(out, get, "encoder.ln_post", "encoder/layer_norm")
    _norm(out, get, "decoder.ln", "decoder/layer_norm")
    out["decoder.token_embedding.weight"] = get.weight("decoder/embeddings")
    out["decoder.positional_embedding"] = get.tensor("decoder/position_encodings/encodings")
    return out


class _Reader:
    def __init__(self, data: memoryview, name: str) -> None:
        self.data = data
        self.pos = 0
        self.name = name

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.data):
            raise ModelLoadError(f"{self.name}: truncated CTranslate2 model file")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def unpack(self, code: str) -> int:
        size = struct.calcsize("<" + code)
        (value,) = struct.unpack("<" + code, self.take(size))
        return int(value)

    def string(self) -> str:
        length = self.unpack("H")
        return bytes(self.take(length)).rstrip(b"\0").decode("utf-8")

    def remaining(self) -> int:
        return len(self.data) - self.pos


class _Getter:
    """Tensor lookup with int8/int16 weights dequantized through their `*_scale`."""

    def __init__(self, variables: dict[str, np.ndarray]) -> None:
        self.variables = variables

    def tensor(self, name: str) -> np.ndarray:
        try:
            return self.variables[name]
        except KeyError:
            raise ModelLoadError(f"not a Whisper CTranslate2 model (no tensor {name})") from None

    def weight(self, prefix: str) -> np.ndarray:
        import numpy as np

        weight = self.tensor(f"{prefix}/weight")
        scale = self.variables.get(f"{prefix}/weight_scale")
        if weight.dtype.kind == "i":
            if scale is None:
                raise ModelLoadError(f"quantized tensor {prefix}/weight has no scale")
            scale = np.asarray(scale, dtype=np.float32).reshape(-1, *([1] * (weight.ndim - 1)))
            return (weight.astype(np.float32) / scale).astype(np.float16)
        return weight

    def bias(self, prefix: str) -> np.ndarray:
        return self.tensor(f"{prefix}/bias")


def _to_array(raw: memoryview, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    import numpy as np

    if dtype == "bfloat16":
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return halves.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def _scalar(value: np.ndarray) -> int:
    return int(value.reshape(-1)[0])


def _count_layers(variables: dict[str, np.ndarray], side: str) -> int:
    count = 0
    while f"{side}/layer_{count}/ffn/linear_0/weight" in variables:
        count += 1
    return count


def _split(get: _Getter, prefix: str, parts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    import numpy as np

    weights = np.split(get.weight(prefix), parts, axis=0)
    biases = np.split(get.bias(prefix), parts, axis=0)
    return list(zip(weights, biases, strict=True))


def _attention(
    out: dict[str, np.ndarray],
    dst: str,
    query: tuple[np.ndarray, np.ndarray],
    key: tuple[np.ndarray, np.ndarray],
    value: tuple[np.ndarray, np.ndarray],
) -> None:
    out[f"{dst}.query.weight"], out[f"{dst}.query.bias"] = query
    out[f"{dst}.key.weight"] = key[0]  # Whisper's key projection has no bias (CT2 stores zeros)
    out[f"{dst}.value.weight"], out[f"{dst}.value.bias"] = value


def _linear(out: dict[str, np.ndarray], get: _Getter, dst: str, src: str) -> None:
    out[f"{dst}.weight"] = get.weight(src)
    out[f"{dst}.bias"] = get.bias(src)


def _norm(out: dict[str, np.ndarray], get: _Getter, dst: str, src: str) -> None:
    out[f"{dst}.weight"] = get.tensor(f"{src}/gamma")
    out[f"{dst}.bias"] = get.tensor(f"{src}/beta")


def _alignment_heads(source: Path, dims: dict[str, int]) -> np.ndarray | None:
    import numpy as np

    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError):
        return None
    heads = config.get("alignment_heads") if isinstance(config, dict) else None
    if not isinstance(heads, list) or not heads:
        return None
    pairs = np.asarray(heads, dtype=np.int32).reshape(-1, 2)
    valid = (pairs[:, 0] < dims["n_text_layer"]) & (pairs[:, 1] < dims["n_text_head"])
    return pairs if bool(valid.all()) else None
