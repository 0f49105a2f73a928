"""Text to speech with Kokoro-82M on MLX (mlx-audio's model code), 24 kHz mono out.

A Kokoro model directory holds `config.json` (model_type "kokoro", the phoneme `vocab`),
`*.safetensors` weights and `voices/<name>.safetensors` style packs (tensor `voice`). Text is
turned into phonemes offline (see `phonemize`); inputs written as `[[...]]` are phonemes
already. mlx-audio's own pipeline (which may download voices and needs misaki) is not used.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel.config import process_env
from mlxcel.engine.audio.arrays import evaluate_all
from mlxcel.engine.audio.phonemize import explicit_phonemes, phonemize
from mlxcel.engine.errors import EngineError, InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import numpy as np

DEFAULT_VOICE = "af_heart"
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MAX_INPUT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech

# OpenAI's voice names → the closest Kokoro-82M voice packs, used when the model has them.
OPENAI_VOICES = {
    "alloy": "af_alloy",
    "ash": "am_adam",
    "ballad": "bm_george",
    "coral": "af_heart",
    "echo": "am_echo",
    "fable": "bm_fable",
    "nova": "af_nova",
    "onyx": "am_onyx",
    "sage": "af_sarah",
    "shimmer": "af_bella",
    "verse": "am_michael",
}
_SENTENCE_END = re.compile(r"(?<=[.!?;:,…])\s+")


class SpeechCancelled(EngineError):
    """The caller stopped a synthesis between two chunks."""


@dataclass
class KokoroModel:
    """A loaded Kokoro model with its voice packs."""

    model: Any  # mlx_audio.tts.models.kokoro.Model
    name: str
    path: Path
    voices: dict[str, Path]
    sample_rate: int
    max_phonemes: int  # per forward pass

    @property
    def default_voice(self) -> str:
        """`af_heart` when present, else the first voice by name."""
        if DEFAULT_VOICE in self.voices:
            return DEFAULT_VOICE
        return min(self.voices) if self.voices else DEFAULT_VOICE


@dataclass(frozen=True)
class Speech:
    """Synthesized audio: mono float32 samples in [-1, 1]."""

    samples: np.ndarray
    sample_rate: int
    voice: str
    phonemes: str

    @property
    def duration(self) -> float:
        """Length in seconds."""
        return len(self.samples) / self.sample_rate


def is_kokoro_dir(path: Path) -> bool:
    """Whether `path` holds a Kokoro checkpoint."""
    config = _read_config(path)
    return config is not None and (
        config.get("model_type") == "kokoro" or ("istftnet" in config and "plbert" in config)
    )


def locate_kokoro(ref: str | None) -> tuple[Path, str]:
    """(checkpoint directory, display name) of the Kokoro model `ref` names, reading no
    weights (cheap enough to run before a server binds); ModelLoadError when there is none."""
    if not ref:
        raise ModelLoadError(
            "no text-to-speech model given: pass a Kokoro-82M directory with -m / --tts-model "
            "(for example an mlx-community/Kokoro-82M-bf16 snapshot)"
        )
    path = _model_path(ref)
    if not is_kokoro_dir(path):
        raise ModelLoadError(f"{ref}: not a Kokoro model directory (no Kokoro config.json)")
    return path, path.name if Path(os.path.expanduser(ref)).is_dir() else ref


def load_kokoro(ref: str | None) -> KokoroModel:
    """Load the Kokoro model in directory (or cached Hugging Face repo) `ref`."""
    path, name = locate_kokoro(ref)
    config = _read_config(path) or {}  # locate_kokoro found it
    from mlxcel.engine.loading.safety import check_model_dir
    from mlxcel.engine.loading.weight_files import check_safetensors

    check_model_dir(path)
    check_safetensors(path, name=name)
    try:
        model = _build(path, config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{name}: {_first_line(exc)}") from exc
    voices = {p.stem: p for p in sorted((path / "voices").glob("*.safetensors"))}
    if not voices:
        raise ModelLoadError(f"{name}: no voice packs (voices/*.safetensors)")
    context = int(model.context_length)
    return KokoroModel(
        model=model,
        name=name,
        path=path,
        voices=voices,
        sample_rate=int(config.get("sample_rate", 24_000)),
        max_phonemes=max(1, context - 2),
    )


def resolve_voice(tts: KokoroModel, voice: str | None) -> str:
    """The voice pack name for `voice` (a pack name or an OpenAI voice name)."""
    if not voice:
        return tts.default_voice
    if voice in tts.voices:
        return voice
    mapped = OPENAI_VOICES.get(voice.lower())
    if mapped is not None:
        return mapped if mapped in tts.voices else tts.default_voice
    raise InvalidRequestError(
        f"unknown voice {voice!r}; available: {', '.join(sorted(tts.voices))}"
    )


def synthesize(
    tts: KokoroModel,
    text: str,
    *,
    voice: str | None = None,
    speed: float = 1.0,
    phonemes: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> Speech:
    """Speak `text` (or, with `phonemes`, the phoneme string `text`) with `voice`."""
    import mlx.core as mx
    import numpy as np

    if not text.strip():
        raise InvalidRequestError("input is empty")
    if len(text) > MAX_INPUT_CHARS:
        raise InvalidRequestError(f"input is longer than {MAX_INPUT_CHARS} characters")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise InvalidRequestError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}")
    name = resolve_voice(tts, voice)
    given = text.strip() if phonemes else explicit_phonemes(text)
    ps = given if given is not None else phonemize(text, british=name.startswith("b"))
    known = "".join(ch for ch in ps if ch in tts.model.vocab)
    if not known.strip():
        raise InvalidRequestError("the input has no phonemes this model can speak")
    pack: Any = _load_arrays(tts.voices[name])["voice"]
    mx.random.seed(0)  # the harmonic source adds noise: keep output reproducible
    pieces = []
    for chunk in split_phonemes(known, tts.max_phonemes):
        if should_stop is not None and should_stop():
            raise SpeechCancelled("speech stopped")
        style = pack[min(len(chunk), pack.shape[0]) - 1]
        style = style.reshape(1, -1)
        output = tts.model(chunk, style, speed, return_output=True)
        pieces.append(np.asarray(output.audio, dtype=np.float32).reshape(-1))
    samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    samples = np.clip(np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
    return Speech(samples=samples, sample_rate=tts.sample_rate, voice=name, phonemes=known)


def split_phonemes(ps: str, limit: int) -> list[str]:
    """`ps` cut into pieces of at most `limit` symbols, at sentence ends, else at spaces."""
    pieces: list[str] = []
    current = ""
    for part in _SENTENCE_END.split(ps.strip()):
        for word in _fit(part, limit):
            joined = f"{current} {word}" if current else word
            if len(joined) <= limit:
                current = joined
            else:
                pieces.append(current)
                current = word
    if current:
        pieces.append(current)
    return [p for p in pieces if p.strip()]


def _fit(part: str, limit: int) -> list[str]:
    if len(part) <= limit:
        return [part]
    words: list[str] = []
    for word in part.split():
        words.extend(word[i : i + limit] for i in range(0, len(word), limit))
    return words


def _build(path: Path, config: dict[str, Any]) -> Any:
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_audio.tts.models.kokoro import Model, ModelConfig
    from mlx_audio.utils import apply_quantization

    config = {**config, "model_path": str(path)}
    model = Model(ModelConfig.from_dict(config))
    weights: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(_load_arrays(file))
    if not weights:
        raise ValueError("no *.safetensors weights")
    weights = model.sanitize(weights)
    apply_quantization(model, config, weights, getattr(model, "model_quant_predicate", None))
    model.load_weights(list(weights.items()), strict=True)
    if mx.default_device() == mx.cpu:  # MLX's half-precision kernels and convolutions are slow

        def widen(value: Any) -> Any:
            half = isinstance(value, mx.array) and value.dtype in (mx.float16, mx.bfloat16)
            return value.astype(mx.float32) if half else value

        model.update(tree_map(widen, model.parameters()))
        from mlxcel.engine.audio.cpu_conv import use_matmul_convs

        if (process_env.kokoro_conv() or "matmul").strip().lower() != "mlx":
            use_matmul_convs(model)  # MLX's CPU convolutions are slow loops
    model.eval()
    evaluate_all(model)
    return model


def _load_arrays(file: Path) -> dict[str, Any]:
    import mlx.core as mx

    loaded = mx.load(str(file))
    if not isinstance(loaded, dict):
        raise ValueError(f"{file.name}: not a tensor file")
    return loaded


def _model_path(ref: str) -> Path:
    path = Path(os.path.expanduser(ref))
    if path.is_dir():
        return path
    from mlxcel.engine.loading.hf_cache import hf_cache_dir, looks_like_repo_id

    if path.exists() or not looks_like_repo_id(ref):
        raise ModelLoadError(f"{ref}: no such model directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(
            str(snapshot_download(ref, cache_dir=str(hf_cache_dir()), local_files_only=True))
        )
    except Exception as exc:  # the hub raises several unrelated types for "not cached"
        raise ModelLoadError(
            f"{ref} is not in the Hugging Face cache; download it with `hf download {ref}` "
            "where the network is allowed, or pass a local directory"
        ) from exc


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
