"""Load a GGUF file (the architectures of `gguf_arch`) as an mlx-lm model plus its tokenizer.

Files holding only F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors are read with `mx.load`, which gives the
Q4/Q8 ones as exact MLX quantized triplets (group size 32). Files with other types (K-quants,
Q5_x, IQ*, ...) are read tensor by tensor instead -- `mx.load` refuses some of those, decodes
Q4_K wrongly and would hold a float16 copy of every one: each quantized tensor is converted
from its raw bytes into the MLX layout nearest its type (`gguf_quants`: exact for
Q4_0/Q4_1/Q8_0/Q5_0/Q5_1 and MXFP4 (MLX's `mxfp4` mode), Q4_K/Q5_K up to one rounding of
each scale, the nearest 8-bit grid for Q6_K, two bits more for the rest), or kept as float
with `keep_float=True` for the types not held bit for bit. Half-precision weights are cast
to float32 when MLX runs on the CPU, where float16 arithmetic is emulated and tens of times
slower.

llama.cpp permutes the Q/K rows of llama-arch files for its interleaved RoPE; they are permuted
back here, so the result is a standard mlx-lm model (RoPE as in Hugging Face). qwen2/qwen3 files
are not permuted. With a `ModelStore`, the converted model is saved once as an MLX directory
keyed by the file's sha256, and later loads read that instead.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import mmap
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.engine.loading.gguf_arch import (
    ArchMetadata,
    GGUFArchitecture,
    find_architecture,
)
from mlxcel.engine.loading.gguf_quants import (
    BF16,
    F16,
    F32,
    FLOAT_TYPES,
    GROUP_SIZE,
    Q4_0,
    Q4_1,
    Q8_0,
    layout,
    to_affine,
    to_mxfp4,
)
from mlxcel.engine.loading.gguf_tokenizer import (
    build_gguf_tokenizer,
    end_of_generation_ids,
    load_saved_tokenizer,
    save_tokenizer,
)
from mlxcel.engine.loading.materialize import materialize
from mlxcel.engine.loading.store import ModelStore

log = logging.getLogger(__name__)

_CONVERSION_VERSION = 7  # bump when the stored form changes: older entries are redone

# ggml types mx.load decodes exactly (Q4_0, Q4_1, Q8_0 as MLX triplets, group size 32).
_MX_EXACT = FLOAT_TYPES | {Q4_0, Q4_1, Q8_0}

_ROPE_FREQS = "rope_freqs.weight"


@dataclass
class GGUFModel:
    """A model loaded from a GGUF file, ready for the engine."""

    model: Any  # mlx-lm style nn.Module: model(inputs[B, L], cache=...) -> logits; has .layers
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    chat_template: str | None
    architecture: str
    context_length: int
    config: dict[str, Any]  # Hugging Face style config.json content
    quantization: str  # llama.cpp file type, e.g. "Q4_1", "Q4_K_M", "F16"
    metadata: dict[str, Any]  # small scalar GGUF metadata (general.*, <arch>.*, tokenizer ids)
    eos_token_ids: tuple[int, ...] = ()  # EOS plus end-of-turn ids the file names
    store_path: Path | None = None  # the store entry this was loaded from or saved to
    from_store: bool = False  # True when the store already held the converted model


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: numpy-order shape, ggml type and absolute byte offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"

    @property
    def block(self) -> tuple[int, int]:
        """(values, bytes) of one block of its type; ValueError for a type gguf-py does not
        know."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            return GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        except (KeyError, ValueError) as exc:
            raise ValueError(f"tensor {self.name}: unknown ggml type {self.ggml_type}") from exc

    @property
    def rows(self) -> int:
        """Rows of its last axis: the product of the other dimensions."""
        return int(np.prod(self.shape[:-1], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        block, size = self.block
        return self.rows * (self.shape[-1] // block) * size


@dataclass
class GGUFHeader:
    """A GGUF file's metadata and tensor directory."""

    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)


def load_gguf(
    path: Path | str, *, store: ModelStore | None = None, keep_float: bool = False
) -> GGUFModel:
    """Load a GGUF model; with `store`, reuse (or save) its converted MLX form.

    `keep_float` keeps tensors of types MLX cannot hold exactly (K-quants, ...) as float16
    instead of re-quantizing them. Raises ValueError for files that are not GGUF, unsupported
    architectures or tensor layouts, OSError for unreadable files.
    """
    path = Path(path)
    _check_magic(path)
    variant = "float" if keep_float else ""
    digest = ""
    if store is not None:
        digest = store.file_hash(path)
        entry = store.find(digest, variant)
        if entry is not None:
            try:
                return load_converted(entry)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                if not entry_damaged(exc, entry):
                    raise  # no file limit, permission, ...: the entry may be fine, keep it
                log.warning("store entry %s unreadable (%s); converting again", entry, exc)
                with contextlib.suppress(OSError, KeyError):
                    store.remove(entry.name)
    result, weights = _convert(path, keep_float=keep_float)
    if store is not None:
        try:
            result.store_path = store.save(
                path,
                digest,
                lambda directory: _write_converted(directory, result, weights),
                variant=variant,
                manifest=_manifest(result),
            )
        except OSError as exc:  # a full disk or read-only store: the model is loaded anyway
            log.warning("could not save %s to the model store: %s", path.name, exc)
    return result


_MISSING = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})


def entry_damaged(exc: BaseException, directory: Path) -> bool:
    """Whether reading the store entry `directory` failed because the entry itself is
    damaged (a file missing, truncated or not what was written) rather than for a reason of
    this process or system (out of file descriptors or memory, no permission, an I/O error).
    A library's own error (`mx.load` raises RuntimeError when it cannot open a file) is
    looked at again by opening the entry's files."""
    if isinstance(exc, OSError):
        return exc.errno in _MISSING
    try:
        for path in directory.iterdir():
            with open(path, "rb"):
                pass
    except OSError as err:
        return err.errno in _MISSING
    return True


def read_gguf_header(path: Path | str) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor directory (no tensor data is read).

    Metadata values come back as Python scalars/strings, lists of strings, or numpy arrays.
    """
    from gguf import GGUFValueType as V

    scalar = {
        V.UINT8: "<B",
        V.INT8: "<b",
        V.UINT16: "<H",
        V.INT16: "<h",
        V.UINT32: "<I",
        V.INT32: "<i",
        V.FLOAT32: "<f",
        V.BOOL: "<?",
        V.UINT64: "<Q",
        V.INT64: "<q",
        V.FLOAT64: "<d",
    }
    numpy_of = {k: np.dtype(v) for k, v in scalar.items()}
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            value = struct.unpack_from(fmt, mm, pos)[0]
            pos += struct.calcsize(fmt)
            return value

        def text() -> str:
            nonlocal pos
            n = take("<Q")
            value = mm[pos : pos + n].decode("utf-8", errors="replace")
            pos += n
            return value

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == V.STRING:
                return text()
            if kind != V.ARRAY:
                return take(scalar[V(kind)])
            item_kind, count = take("<I"), take("<Q")
            if item_kind == V.STRING:
                return [text() for _ in range(count)]
            if item_kind == V.ARRAY:
                return [value(V.ARRAY) for _ in range(count)]
            dtype = numpy_of[V(item_kind)]
            array = np.frombuffer(mm[pos : pos + count * dtype.itemsize], dtype=dtype)
            pos += count * dtype.itemsize
            return array

        if mm[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        version = struct.unpack_from("<I", mm, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        pos = 8
        try:
            n_tensors, n_kv = take("<Q"), take("<Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = text()
                metadata[key] = value(take("<I"))
            infos = []
            for _ in range(n_tensors):
                name = text()
                dims = [take("<Q") for _ in range(take("<I"))]
                infos.append((name, tuple(reversed(dims)), take("<I"), take("<Q")))
        except (struct.error, ValueError, KeyError) as exc:
            where = "cut off" if isinstance(exc, struct.error) else f"malformed ({exc})"
            raise ValueError(
                f"truncated or corrupt GGUF: the header is {where} at byte {pos} of {len(mm)}"
            ) from exc
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        size = len(mm)
    tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]
    _check_complete(tensors, size)
    return GGUFHeader(metadata=metadata, tensors=tensors)


def _check_complete(tensors: list[TensorInfo], size: int) -> None:
    """ValueError naming what is missing when tensor data lies past the end of the file, or
    the first tensor whose rows do not split into whole blocks of its type."""
    missing = []
    for info in tensors:
        try:
            values, _size = info.block
        except ValueError:  # an unknown ggml type: its size cannot be told
            continue
        if info.shape and info.shape[-1] % values:
            raise ValueError(
                f"truncated or corrupt GGUF: tensor {info.name} ({info.type_name}) has rows of "
                f"{info.shape[-1]} values, not whole {values}-value blocks"
            )
        end = info.offset + info.nbytes
        if end > size:
            missing.append((info, end))
    if not missing:
        return
    need = max(end for _info, end in missing)
    first = missing[0][0].name
    raise ValueError(
        f"truncated or corrupt GGUF: the file has {size} bytes but its tensor data needs "
        f"{need}; {len(missing)} of {len(tensors)} tensors are cut off or missing "
        f"(first: {first})"
    )


def load_converted(directory: Path) -> GGUFModel:
    """Load a model directory `load_gguf` wrote into the store."""
    directory = Path(directory)
    manifest = json.loads((directory / "mlxcel.json").read_text())
    if manifest.get("conversion") != _CONVERSION_VERSION:
        raise ValueError("converted by another mlxcel version")
    config = json.loads((directory / "config.json").read_text())
    # the tokenizer first: reading it peaks at several times its size, better before the
    # weights are in memory than after
    tokenizer = load_saved_tokenizer(directory)
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    model = _build_model(config, weights, manifest.get("rope_factors"))
    return GGUFModel(
        model=model,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        architecture=str(manifest["architecture"]),
        context_length=int(manifest["context_length"]),
        config=config,
        quantization=str(manifest["quantization"]),
        metadata=dict(manifest.get("metadata", {})),
        eos_token_ids=tuple(manifest.get("eos_token_ids", ())),
        store_path=directory,
        from_store=True,
    )


# --- conversion -------------------------------------------------------------------------


def _check_magic(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")


def gguf_config(path: Path) -> tuple[GGUFHeader, GGUFArchitecture, dict[str, Any]]:
    """The file's header, its architecture and the Hugging Face config it gives (ValueError
    for an architecture or layout mlxcel does not read); only small tensors are read."""
    header = read_gguf_header(path)
    metadata = header.metadata
    arch = find_architecture(str(metadata.get("general.architecture", "")), metadata)
    tensors = {t.name: t for t in header.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("no token_embd.weight tensor")
    return header, arch, _hf_config(arch, metadata, tensors, _tensor_reader(path, tensors))


def model_for_config(config: dict[str, Any]) -> nn.Module:
    """mlx-lm's network for a Hugging Face config, its arrays as initialized (lazy)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model: nn.Module = module.Model(module.ModelArgs.from_dict(config))
    return model


def _convert(path: Path, *, keep_float: bool) -> tuple[GGUFModel, dict[str, Any]]:
    header, arch, config = gguf_config(path)
    metadata = header.metadata
    architecture = str(metadata.get("general.architecture", ""))
    weights, rope_factors = _convert_weights(path, header, config, arch, keep_float=keep_float)
    bits = Counter(_bits(weights, key) for key in weights if key.endswith(".scales"))
    if bits:  # for mlx-lm: the most common width; each layer's own is inferred from its shapes
        config["quantization"] = {
            "group_size": GROUP_SIZE,
            "bits": bits.most_common(1)[0][0],
            "mode": "affine",
        }
    model = _build_model(config, weights, rope_factors)
    tokenizer = build_gguf_tokenizer(metadata)
    loaded = GGUFModel(
        model=model,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        architecture=architecture,
        context_length=int(config["max_position_embeddings"]),
        config=config,
        quantization=file_type(metadata, header.tensors),
        metadata=_small_metadata(metadata),
        eos_token_ids=end_of_generation_ids(metadata),
    )
    return loaded, weights


def _tensor_reader(path: Path, tensors: dict[str, TensorInfo]) -> Callable[[str], np.ndarray]:
    """Reads one tensor of the file at `path` by name (a small one: its values in memory)."""

    def read(name: str) -> np.ndarray:
        with open(path, "rb") as f:
            return np.array(read_tensor_values(f, tensors[name]))

    return read


def _hf_config(
    arch: GGUFArchitecture,
    md: dict[str, Any],
    tensors: dict[str, TensorInfo],
    read_tensor: Callable[[str], np.ndarray],
) -> dict[str, Any]:
    """The Hugging Face `config.json` of the file: the keys every architecture shares, then
    the architecture's own."""
    hyper = ArchMetadata(arch.name, md, frozenset(tensors), read_tensor)
    get = hyper.get
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config: dict[str, Any] = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_architecture],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", arch.default_rms_eps)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", arch.default_rope_theta)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32" if tensors["token_embd.weight"].ggml_type == F32 else "float16",
    }
    scaling = str(md.get(f"{arch.name}.rope.scaling.type", "none"))
    factor = md.get(f"{arch.name}.rope.scaling.factor")
    if scaling in ("linear", "yarn") and factor:
        config["rope_scaling"] = {"type": scaling, "rope_type": scaling, "factor": float(factor)}
        original = md.get(f"{arch.name}.rope.scaling.original_context_length")
        if original:
            config["rope_scaling"]["original_max_position_embeddings"] = int(original)
    config.update(arch.extra_config(hyper, config))
    return config


def _convert_weights(
    path: Path,
    header: GGUFHeader,
    config: dict[str, Any],
    arch: GGUFArchitecture,
    *,
    keep_float: bool,
) -> tuple[dict[str, Any], list[float] | None]:
    """GGUF tensors → mlx-lm weights (HF names, llama's Q/K rows un-permuted, norm weights
    less what the converter added)."""
    dtype = mx.float32 if config["torch_dtype"] == "float32" else mx.float16  # the stored form
    rope_factors: list[float] | None = None
    unknown: list[str] = []
    weights: dict[str, Any] = {}
    with open(path, "rb") as f:
        native = _load_native(path, header.tensors, f)
        for info in header.tensors:
            if info.name == _ROPE_FREQS and arch.permuted_qk:
                rope_factors = read_tensor_values(f, info).astype(np.float32).tolist()
                continue
            if info.name in arch.config_tensors:  # read into the config already
                continue
            target = arch.hf_name(info.name)
            if target is None:
                unknown.append(info.name)
                continue
            if arch.norm_offset and target.endswith("norm.weight"):
                # the converter's `1 + w`, taken off in float32 before the stored dtype
                shifted = read_tensor_values(f, info).astype(np.float32) - arch.norm_offset
                parts = {"weight": mx.array(shifted)}
            elif native is not None:
                parts = _from_native(native, info)
            else:
                parts = _from_raw(f, info, dtype, keep_float=keep_float)
            base = target.removesuffix(".weight")
            for suffix, array in parts.items():
                key = target if suffix == "weight" else f"{base}.{suffix}"
                floating = mx.issubdtype(array.dtype, mx.floating)
                weights[key] = array.astype(dtype) if floating else array  # codes, E8M0
    if unknown:
        raise ValueError(f"unsupported tensors in the GGUF file: {', '.join(unknown[:5])}")
    if arch.permuted_qk:
        _unpermute_qk(weights, config)
    arch.fix_weights(weights, config)
    return weights, rope_factors


def _load_native(path: Path, tensors: list[TensorInfo], f: Any) -> dict[str, Any] | None:
    """`mx.load`'s tensors when it can decode all of them exactly, else None.

    `mx.load` turns every other type into float16 (costly for K-quant files, and wrong for
    Q4_K), and older MLX versions decoded Q4_1 wrongly, so the smallest tensor of each quantized
    type is checked against our own repacking.
    """
    if any(t.ggml_type not in _MX_EXACT for t in tensors):
        return None
    try:
        native = mx.load(str(path))
    except (RuntimeError, ValueError):
        return None
    assert isinstance(native, dict)
    checked: set[int] = set()
    for info in sorted(tensors, key=lambda t: t.nbytes):
        if info.ggml_type not in FLOAT_TYPES and info.ggml_type not in checked:
            checked.add(info.ggml_type)
            ours = _from_raw(f, info, mx.float16, keep_float=False)
            theirs = _from_native(native, info)
            if ours.keys() != theirs.keys() or not all(
                mx.array_equal(ours[k], theirs[k]) for k in ours
            ):
                log.warning(
                    "mx.load decodes %s differently; reading tensors directly", info.type_name
                )
                return None
    return native


def _from_native(native: dict[str, Any], info: TensorInfo) -> dict[str, Any]:
    base = info.name.removesuffix(".weight")
    if f"{base}.scales" in native:
        return {
            "weight": native[info.name],
            "scales": native[f"{base}.scales"],
            "biases": native[f"{base}.biases"],
        }
    return {"weight": native[info.name]}


def _from_raw(f: Any, info: TensorInfo, dtype: Any, *, keep_float: bool) -> dict[str, Any]:
    """One tensor read from the file: float types as float, quantized ones as MLX triplets
    (`gguf_quants.to_affine`; MXFP4 as MLX's `mxfp4` pair, `to_mxfp4`), from the raw
    bytes; with `keep_float`, types MLX does not hold bit for bit (K-quants, IQ*, ...) as
    float instead. A tensor whose rows do not split into
    groups of 32, or whose scales overflow float16, is read as float."""
    quantized = info.ggml_type not in FLOAT_TYPES and len(info.shape) >= 2
    if quantized and info.shape[-1] % GROUP_SIZE == 0:
        kind = layout(info.ggml_type, info.type_name)
        if kind.fidelity == "exact" or not keep_float:
            row_bytes = info.nbytes // info.rows

            def read_rows(start: int, stop: int) -> np.ndarray:
                f.seek(info.offset + start * row_bytes)
                raw = np.frombuffer(f.read((stop - start) * row_bytes), dtype=np.uint8)
                return raw.reshape(stop - start, row_bytes)

            stored = np.float16 if dtype == mx.float16 else np.float32
            try:
                if kind.mode == "mxfp4":
                    return {k: mx.array(v) for k, v in to_mxfp4(read_rows, info.shape).items()}
                parts = to_affine(read_rows, info.ggml_type, info.type_name, info.shape, stored)
            except ValueError as exc:
                raise ValueError(f"tensor {info.name}: {exc}") from exc
            if parts is not None:
                return {k: mx.array(v) for k, v in parts.items()}
    return {"weight": mx.array(read_tensor_values(f, info)).astype(dtype)}


def read_tensor_values(f: Any, info: TensorInfo) -> np.ndarray:
    """A tensor's values: float types as stored, quantized types dequantized to float32 with
    the gguf package; ValueError for a type it cannot read."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    f.seek(info.offset)
    raw = np.frombuffer(f.read(info.nbytes), dtype=np.uint8)
    if info.ggml_type == F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.ggml_type == F16:
        return raw.view(np.float16).reshape(info.shape)
    if info.ggml_type == BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    rows = raw.reshape(*info.shape[:-1], -1)
    try:
        values = dequantize(rows, GGMLQuantizationType(info.ggml_type))
    except (ValueError, NotImplementedError) as exc:
        raise ValueError(f"tensor {info.name}: cannot read type {info.type_name}") from exc
    return np.asarray(values, dtype=np.float32).reshape(info.shape)


def _bits(weights: dict[str, Any], scales_key: str) -> int:
    """Bits per value of the quantized weight whose scales are `scales_key`."""
    base = scales_key.removesuffix(".scales")
    packed_bits = weights[f"{base}.weight"].shape[-1] * 32
    return int(packed_bits // (weights[scales_key].shape[-1] * GROUP_SIZE))


def _unpermute_qk(weights: dict[str, Any], config: dict[str, Any]) -> None:
    """Undo llama.cpp's Q/K row permutation (interleaved → half-split RoPE layout)."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for key, value in list(weights.items()):
        parts = key.split(".")
        if len(parts) >= 2 and parts[-2] in heads and parts[-3] == "self_attn":
            n = heads[parts[-2]]
            rows = value.shape[0]
            shape = (n, rows // n // 2, 2, *value.shape[1:])
            weights[key] = value.reshape(shape).swapaxes(1, 2).reshape(value.shape)


def compute_dtype(config: dict[str, Any]) -> Any:
    """The float dtype a model computes in: float32 on the CPU backend, where half precision
    is emulated and tens of times slower; otherwise the stored `torch_dtype`."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return mx.float32
    return mx.float32 if config.get("torch_dtype") == "float32" else mx.float16


def _build_model(
    config: dict[str, Any], weights: dict[str, Any], rope_factors: list[float] | None = None
) -> Any:
    """An mlx-lm model for `config` holding `weights` (quantized where they carry scales)."""
    dtype = compute_dtype(config)
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    model = model_for_config(config)
    if hasattr(model, "sanitize"):  # the class's own fix-ups (gemma3_text: tied embeddings)
        weights = model.sanitize(weights)

    def quantized(path: str, layer: Any) -> Any:
        if f"{path}.scales" not in weights or not hasattr(layer, "to_quantized"):
            return False
        bits = _bits(weights, f"{path}.scales")
        if f"{path}.biases" not in weights:  # MXFP4: E8M0 scale bytes, no biases
            return {"group_size": GROUP_SIZE, "bits": bits, "mode": "mxfp4"}
        return {"group_size": GROUP_SIZE, "bits": bits}

    _check_shapes(model, weights)
    nn.quantize(model, group_size=GROUP_SIZE, bits=4, class_predicate=quantized)
    model.load_weights(list(weights.items()), strict=True)
    if rope_factors is not None:
        dims = int(config["head_dim"])
        rope = _FactoredRoPE(dims, float(config["rope_theta"]), rope_factors)
        for layer in model.layers:
            layer.self_attn.rope = rope
    materialize(model)
    model.eval()
    return model


def _check_shapes(model: nn.Module, weights: dict[str, Any]) -> None:
    """ValueError naming the first weight whose shape (a quantized one's unpacked) is not
    the one the model's hyper-parameters give it."""
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    for key, value in weights.items():
        want = expected.get(key)
        if want is None:  # scales, biases; names the model lacks fail its strict load
            continue
        shape = tuple(value.shape)
        scales = weights.get(f"{key.removesuffix('.weight')}.scales")
        if key.endswith(".weight") and scales is not None:
            shape = (*shape[:-1], scales.shape[-1] * GROUP_SIZE)
        if shape != tuple(want.shape):
            raise ValueError(
                f"inconsistent GGUF: {key} has shape {shape}, but the file's "
                f"hyper-parameters give {tuple(want.shape)}"
            )


class _FactoredRoPE(nn.Module):
    """RoPE whose per-frequency wavelengths are scaled by a GGUF `rope_freqs` tensor (Llama 3)."""

    def __init__(self, dims: int, base: float, factors: list[float]) -> None:
        super().__init__()
        self.dims = dims
        self.factors = list(factors)
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (base**exponents) * mx.array(factors, dtype=mx.float32)

    def __call__(self, x: Any, offset: Any = 0) -> Any:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs
        )


def file_type(metadata: dict[str, Any], tensors: list[TensorInfo]) -> str:
    """The file's quantization as llama.cpp names it (`Q4_K_M`...), else its most common
    2-D tensor type."""
    from gguf import LlamaFileType

    value = metadata.get("general.file_type")
    try:
        name = LlamaFileType(int(value)).name if value is not None else ""
    except ValueError:
        name = ""
    if name and name != "GUESSED":
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts = Counter(t.type_name for t in tensors if len(t.shape) == 2)
    return counts.most_common(1)[0][0] if counts else "unknown"


def _small_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    small: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 256):
            small[key] = value
    return small


# --- the store form -----------------------------------------------------------------------


def _manifest(result: GGUFModel) -> dict[str, Any]:
    rope = getattr(result.model.layers[0].self_attn, "rope", None)
    return {
        "conversion": _CONVERSION_VERSION,
        "architecture": result.architecture,
        "context_length": result.context_length,
        "quantization": result.quantization,
        "metadata": result.metadata,
        "eos_token_ids": list(result.eos_token_ids),
        "rope_factors": rope.factors if isinstance(rope, _FactoredRoPE) else None,
    }


def _write_converted(directory: Path, result: GGUFModel, weights: dict[str, Any]) -> None:
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(result.config, indent=2))
    save_tokenizer(result.tokenizer, directory)
