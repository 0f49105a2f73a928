"""Resolve a model reference (GGUF file, MLX dir, HF repo id, or nothing) and load it."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.loading.default_model import DEFAULT_MODEL_NAME, default_model_path
from mlxcel.engine.loading.describe import quantization_label
from mlxcel.engine.loading.model import LoadedModel, ModelInfo
from mlxcel.engine.process_memory import release_memory
from mlxcel.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mlxcel.engine.distributed.group import Ranks

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_LENGTH = 4096


def load_model(
    ref: str | None,
    *,
    store_dir: str | None = None,
    chat_template: str | None = None,
    cpu_dtype: str = "keep",
    cpu_threads: int = -1,
    ranks: Ranks | None = None,
    pipeline: bool = False,
) -> LoadedModel:
    """Load the text model `ref` names; None means the embedded default model.

    `ref` may be a `.gguf` file, a local MLX/Hugging Face directory, or a Hugging
    Face repo id found in the local cache. `chat_template` overrides the model's.
    `cpu_dtype` (CPU backend only): `keep` leaves quantized weights packed for MLX's own
    (slow on the CPU) quantized matmul; `float32` dequantizes them at load; `auto` runs
    them on mlxcel's CPU kernel (packed weights, several times faster than float32 for
    decode) with a float32 copy for prefill when it fits comfortably in memory, and falls
    back to `float32` when the kernel cannot be built here. `cpu_threads` (> 0) sets the
    kernel's threads (else one per core, at most 8). `ranks`: a group of ranks, of which
    this process keeps only its shard (`mlxcel.engine.distributed.shard`; `pipeline`: by
    layers).
    """
    if not ref:
        loaded = _load_gguf(default_model_path(), store_dir, source="default")
        loaded.info = _with(loaded.info, name=DEFAULT_MODEL_NAME)
    else:
        path = Path(os.path.expanduser(ref))
        if path.is_file():
            if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
                raise ModelLoadError(f"{ref}: not a GGUF file or a model directory")
            loaded = _load_gguf(path, store_dir, source="gguf")
        elif path.is_dir():
            loaded = _load_mlx_dir(path, source="mlx", name=path.name, lazy=ranks is not None)
        else:
            loaded = _load_repo_id(ref)
    if chat_template is not None:
        loaded.tokenizer.chat_template = chat_template
    if ranks is not None:
        from mlxcel.engine.distributed.shard import shard_loaded

        shard_loaded(loaded, ranks, pipeline=pipeline)
    _use_float32_on_cpu(loaded.model)
    _apply_cpu_dtype(loaded, cpu_dtype, cpu_threads)
    from mlxcel.engine.loading.materialize import materialize

    materialize(loaded.model)  # the engine runs it on another thread
    # Reading, converting and building the tokenizer leave hundreds of MB freed but held by
    # the allocator (262k-token vocabularies especially): hand them back.
    release_memory()
    return loaded


def check_model_ref(ref: str | None) -> None:
    """Refuse a model reference that cannot be loaded, without reading weights (ModelLoadError).

    None (the embedded default) needs its package; a file must be a GGUF file whose header
    parses; a directory needs `config.json`; anything else must look like a Hugging Face repo
    id, and be cached when downloads are off. Cheap enough to run before a server binds.
    """
    if not ref:
        default_model_path()  # ModelLoadError naming the package to install
        return
    path = Path(os.path.expanduser(ref))
    if path.is_file():
        from mlxcel.engine.loading.gguf import read_gguf_header

        if not _has_gguf_magic(path):
            raise ModelLoadError(f"{ref}: not a GGUF file or a model directory")
        try:
            read_gguf_header(path)
        except ValueError as exc:  # says "truncated or corrupt GGUF" and what is missing
            raise ModelLoadError(f"{ref}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
            raise ModelLoadError(f"{ref}: truncated or corrupt GGUF header ({exc})") from None
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path.name}: no config.json; not an MLX or Hugging Face model directory"
            )
    else:
        from mlxcel.engine.loading.hf_cache import hf_offline, looks_like_repo_id, resolve_hf_repo

        if not looks_like_repo_id(ref):
            raise ModelLoadError(
                f"{ref}: no such file or directory, and not a Hugging Face repo id"
            )
        if hf_offline():
            try:
                resolve_hf_repo(ref, allow_download=False)
            except ValueError as exc:
                raise ModelLoadError(str(exc).splitlines()[0]) from None


def _apply_cpu_dtype(loaded: LoadedModel, policy: str, threads: int) -> None:
    import mlx.core as mx

    if policy == "keep" or mx.default_device() != mx.cpu:
        return
    kernels = _cpu_kernels(threads) if policy == "auto" else None
    if kernels is not None:
        from mlxcel.engine.cpu_kernels.activations import use_gelu_kernel, use_silu_kernel
        from mlxcel.engine.cpu_kernels.attention import use_attention_kernel
        from mlxcel.engine.cpu_kernels.layers import use_norm_kernel, use_rope_kernel

        use_rope_kernel(loaded.model, kernels)  # MLX's CPU rope recomputes every angle
        use_norm_kernel(loaded.model, kernels)  # its rms_norm is several ops,
        use_attention_kernel(kernels)  # so is its attention,
        use_silu_kernel(kernels)  # and its exp is scalar,
        use_gelu_kernel(kernels)  # as are the GELU's tanh and pow
        if kernels.simd == "scalar":
            kernels = None  # the portable matmuls are not faster than float32 BLAS (no SIMD)
    if not _is_quantized(loaded.model):
        if kernels is not None:
            _use_dense_kernels(loaded, kernels)
        return
    fits = _float32_fits(loaded)
    if kernels is not None:
        from mlxcel.engine.cpu_kernels.layers import use_cpu_kernels

        # The float32 copy only pays for prefill on a real BLAS; MLX's bundled reference BLAS
        # is slower than the kernel at any size.
        dense = fits and _fast_blas()
        if use_cpu_kernels(loaded.model, kernels, dense=dense):
            held = [m for _, m in loaded.model.named_modules() if "packed" in m or "dense" in m]
            notes = [", int8 tiles" if any("packed" in m for m in held) else ""]
            notes.append(" + float32 for prefill" if any("dense" in m for m in held) else "")
            quant = f"{loaded.info.quantization} (mlxcel CPU kernel{''.join(notes)})"
            loaded.info = _with(loaded.info, quantization=quant)
            return
    if policy == "float32" or fits:
        _dequantize(loaded.model)
        loaded.info = _with(loaded.info, quantization=f"{loaded.info.quantization} → float32")


def _cpu_kernels(threads: int) -> Any:
    """mlxcel's CPU kernel module with `threads` (> 0) set, or None where it is unavailable."""
    from mlxcel.engine.cpu_kernels.build import load_kernels

    kernels = load_kernels()
    if kernels is not None and threads > 0:
        kernels.set_threads(threads)
    return kernels


def _use_dense_kernels(loaded: LoadedModel, kernels: Any) -> None:
    """A float32 model's few-row matmuls (decode, batched decode) on the CPU kernel."""
    from mlxcel.engine.cpu_kernels.layers import use_dense_kernels

    if use_dense_kernels(loaded.model, kernels):
        quant = loaded.info.quantization
        name = "float32" if quant in ("", "none") else quant
        loaded.info = _with(loaded.info, quantization=f"{name} (mlxcel CPU kernel for decode)")


def _fast_blas() -> bool:
    from mlxcel.engine.blas import blas_in_use

    return not blas_in_use().startswith("bundled reference BLAS")


def _is_quantized(model: Any) -> bool:
    import mlx.nn as nn

    return any(
        isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        for _, module in model.named_modules()
    )


def _float32_fits(loaded: LoadedModel) -> bool:
    """Float32 weights take at most a quarter of the machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    return loaded.info.num_parameters * 4 <= total // 4


def _dequantize(model: Any) -> None:
    """Replace every quantized linear/embedding layer by its float32 equivalent."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    replacements = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        weight = mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        ).astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            layer: Any = nn.Embedding(weight.shape[0], weight.shape[1])
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                layer.bias = module.bias.astype(mx.float32)
        layer.weight = weight
        replacements.append((name, layer))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
        mx.eval(model.parameters())


def _use_float32_on_cpu(model: Any) -> None:
    """On the CPU backend, compute in float32: half-precision math there is emulated and
    many times slower. Quantized weights stay packed; their scales and every other
    float16/bfloat16 parameter become float32."""
    import mlx.core as mx
    from mlx.utils import tree_map

    if mx.default_device() != mx.cpu:
        return
    half = (mx.float16, mx.bfloat16)

    def widen(value: Any) -> Any:
        return value.astype(mx.float32) if getattr(value, "dtype", None) in half else value

    model.update(tree_map(widen, model.parameters()))
    mx.eval(model.parameters())


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _with(info: ModelInfo, **changes: Any) -> ModelInfo:
    from dataclasses import replace

    return replace(info, **changes)


def _family(architecture: str, template: str | None) -> str:
    from mlxcel.engine.chat.template import detect_family

    if architecture.startswith("gemma4"):
        return "gemma4"
    return detect_family(template) if template else "generic"


def _load_gguf(path: Path, store_dir: str | None, *, source: str) -> LoadedModel:
    from mlxcel.engine.loading.gguf import load_gguf
    from mlxcel.engine.loading.store import ModelStore

    store = ModelStore(Path(store_dir)) if store_dir else ModelStore.default()
    try:
        gguf = load_gguf(path, store=store)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path.name}: {_first_line(exc)}") from exc
    tokenizer = Tokenizer(
        gguf.tokenizer,
        eos_token_ids=getattr(gguf, "eos_token_ids", ()),
        chat_template=gguf.chat_template,
    )
    info = ModelInfo(
        name=path.stem,
        source=source,
        path=path,
        architecture=gguf.architecture,
        context_length=int(gguf.context_length or DEFAULT_CONTEXT_LENGTH),
        quantization=gguf.quantization,
        family=_family(gguf.architecture, tokenizer.chat_template),
        num_parameters=_count_parameters(gguf.model),
    )
    return LoadedModel(model=gguf.model, tokenizer=tokenizer, info=info)


def _load_mlx_dir(path: Path, *, source: str, name: str, lazy: bool = False) -> LoadedModel:
    from mlxcel.engine.loading.safety import check_model_dir
    from mlxcel.engine.loading.weight_files import check_safetensors

    check_model_dir(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{name}: no config.json; not an MLX or Hugging Face model directory")
    check_safetensors(path, name=name)
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, wrapper, config = mlx_lm_load(str(path), lazy=lazy, return_config=True)  # type: ignore[misc]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{name}: {_first_line(exc)}") from exc
    hf_tokenizer = wrapper._tokenizer
    eos = set(getattr(wrapper, "eos_token_ids", ()) or ())
    eos |= _generation_config_eos(path)
    tokenizer = Tokenizer(hf_tokenizer, eos_token_ids=eos)
    architecture = str(config.get("model_type", "unknown"))
    info = ModelInfo(
        name=name,
        source=source,
        path=path,
        architecture=architecture,
        context_length=int(
            config.get("max_position_embeddings")
            or config.get("max_seq_len")
            or DEFAULT_CONTEXT_LENGTH
        ),
        quantization=quantization_label(config),
        family=_family(architecture, tokenizer.chat_template),
        num_parameters=_count_parameters(model),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def _load_repo_id(ref: str) -> LoadedModel:
    from mlxcel.engine.loading.hf_cache import looks_like_repo_id, resolve_hf_repo

    if not looks_like_repo_id(ref):
        raise ModelLoadError(f"{ref}: no such file or directory, and not a Hugging Face repo id")
    try:
        path = resolve_hf_repo(ref)
    except ValueError as exc:
        raise ModelLoadError(_first_line(exc)) from exc
    return _load_mlx_dir(path, source="hf-cache", name=ref)


def _generation_config_eos(path: Path) -> set[int]:
    config_path = path / "generation_config.json"
    if not config_path.is_file():
        return set()
    try:
        eos = json.loads(config_path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in eos} if isinstance(eos, list) else set()


def _count_parameters(model: Any) -> int:
    """Parameters as the model defines them (quantized weights counted unpacked)."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    total = sum(int(value.size) for _, value in leaves)
    for _, module in model.named_modules():
        bits = getattr(module, "bits", None)
        weight = getattr(module, "weight", None)
        if not bits or weight is None or "scales" not in module:
            continue
        packed = int(weight.size) + int(module["scales"].size)
        packed += int(module["biases"].size) if "biases" in module else 0
        total += int(weight.size) * 32 // int(bits) - packed
    return total


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
