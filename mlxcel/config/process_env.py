"""The `MLXCEL_*` environment variables read outside the settings model: the one place that
reads them, each through a typed function called when the value is needed (so a variable set
after import, as tests do, still counts).

They tune the process rather than one served model (CPU kernels, BLAS, Whisper's forward
pass, media access, the request memory budget) or stand in for a setting where no settings
are resolved (the model store, loop detection, the CLI's default audio and speech models).
Each is documented with its feature (docs/cpu.md, docs/audio.md, docs/vision.md,
docs/reliability.md, docs/configuration.md, docs/settings-reference.md). Importing this
module loads nothing else of the settings layer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CPU_KERNELS = "MLXCEL_CPU_KERNELS"
"""`off` (or 0, false, no, none): do not build or use mlxcel's CPU kernel."""
KERNEL_DIR = "MLXCEL_KERNEL_DIR"
"""Where the CPU kernel and the BLAS shim are built and cached."""
KERNEL_CFLAGS = "MLXCEL_KERNEL_CFLAGS"
"""Extra compiler flags for the CPU kernel, e.g. `-mno-avx512f`."""
KERNEL_INT8 = "MLXCEL_KERNEL_INT8"
"""`off`: no int8 tiles, float32 activations in the CPU kernel."""
BLAS = "MLXCEL_BLAS"
"""`auto`, `pypi`, `system`, `off` or a library path: the BLAS loaded under MLX."""
BATCHED_SAMPLING = "MLXCEL_BATCHED_SAMPLING"
"""`0`: each request samples on its own instead of in one batched call."""
WHISPER_FORWARD = "MLXCEL_WHISPER_FORWARD"
"""`numpy`, `mlx` or `auto`: what runs Whisper's encoder and decoder."""
WHISPER_AUDIO_CTX = "MLXCEL_WHISPER_AUDIO_CTX"
KOKORO_CONV = "MLXCEL_KOKORO_CONV"
"""`auto` or `full`: how much of the 30-second window Whisper's numpy encoder encodes."""
ALLOW_PRIVATE_MEDIA_URLS = "MLXCEL_ALLOW_PRIVATE_MEDIA_URLS"
"""Exactly `1`: media URLs may resolve to non-public addresses."""
MEDIA_PROCESSES = "MLXCEL_MEDIA_PROCESSES"
"""`0`: decode data URIs and pictures on the server's media threads, not in worker processes."""
VIDEO_DIR_ALLOWLIST = "MLXCEL_VIDEO_DIR_ALLOWLIST"
"""Comma-separated absolute directories local video may be read from."""
REQUEST_MEMORY_BUDGET = "MLXCEL_REQUEST_MEMORY_BUDGET"
"""A byte size (`12G`, `512M`) lowering the memory requests may claim."""
SERVER_URL = "MLXCEL_URL"
"""`mlxcel cache stats|reset`'s server (`--url`; typer reads it)."""
# The variables of settings fields (`MLXCEL_<FIELD>`), read here where no settings are resolved.
MODEL_STORE = "MLXCEL_MODEL_STORE"
"""The converted-model store (the `model_store` setting)."""
LOOP_DETECTION = "MLXCEL_LOOP_DETECTION"
"""Loop detection server-wide (the `loop_detection` setting)."""
AUDIO_MODEL = "MLXCEL_AUDIO_MODEL"
"""`mlxcel transcribe`'s default model (the `audio_model` setting)."""
TTS_MODEL = "MLXCEL_TTS_MODEL"
"""`mlxcel speak`'s default model (the `tts_model` setting)."""
PROMPT_CACHE_DIR = "MLXCEL_PROMPT_CACHE_DIR"
"""`mlxcel cache prompts`' directory (the `prompt_cache_dir` setting)."""
IMAGE_MODEL = "MLXCEL_IMAGE_MODEL"
"""`mlxcel image`'s default model (the `image_model` setting; read with the settings)."""
_OFF = ("off", "0", "false", "no", "none")


def _text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's text; None when it is unset or empty."""
    value = (os.environ if environ is None else environ).get(name)
    return value or None


def _switch(name: str) -> bool:
    """False when the variable says off (off, 0, false, no, none); on when unset."""
    return (_text(name) or "auto").strip().lower() not in _OFF


def cpu_kernels_enabled() -> bool:
    """`MLXCEL_CPU_KERNELS`: False when it turns the CPU kernel off."""
    return _switch(CPU_KERNELS)


def kernel_int8_enabled() -> bool:
    """False when `MLXCEL_KERNEL_INT8=off` keeps float32 activations (and MLX's layout for
    every layer); by default, where the CPU has integer dot products (AVX-512 VNNI), 4/8-bit
    layers are repacked into the kernel's int8 tiles and the others round 4-bit activations
    to int8, prefill through a float32 copy included (the kernel's `round_int8`)."""
    return _switch(KERNEL_INT8)


def kernel_cflags() -> str:
    """`MLXCEL_KERNEL_CFLAGS`, the extra compiler flags ("" when unset)."""
    return os.environ.get(KERNEL_CFLAGS, "")


def kernel_cache_dir() -> Path:
    """`$MLXCEL_KERNEL_DIR`, else `$XDG_CACHE_HOME/mlxcel/kernels`, else
    `~/.cache/mlxcel/kernels`: where the CPU kernel and the BLAS shim are cached."""
    chosen = _text(KERNEL_DIR)
    if chosen:
        return Path(chosen).expanduser()
    xdg = _text("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlxcel" / "kernels"


def blas_choice() -> str:
    """`MLXCEL_BLAS` as given (stripped), `auto` when unset or blank."""
    return os.environ.get(BLAS, "auto").strip() or "auto"


def batched_sampling() -> bool:
    """`MLXCEL_BATCHED_SAMPLING`: False only when it is `0`."""
    return os.environ.get(BATCHED_SAMPLING, "1") != "0"


def whisper_forward() -> str | None:
    """`MLXCEL_WHISPER_FORWARD` as given (None when unset or empty)."""
    return _text(WHISPER_FORWARD)


def whisper_audio_ctx() -> str | None:
    """`MLXCEL_WHISPER_AUDIO_CTX` as given (None when unset or empty)."""
    return _text(WHISPER_AUDIO_CTX)


def kokoro_conv() -> str | None:
    """`MLXCEL_KOKORO_CONV` as given (None when unset or empty)."""
    return _text(KOKORO_CONV)


def allow_private_media_urls(environ: Mapping[str, str] | None = None) -> bool:
    """`MLXCEL_ALLOW_PRIVATE_MEDIA_URLS`: True only when it is exactly `1`."""
    return _text(ALLOW_PRIVATE_MEDIA_URLS, environ) == "1"


def media_processes() -> bool:
    """`MLXCEL_MEDIA_PROCESSES`: False only when it is `0`."""
    return os.environ.get(MEDIA_PROCESSES, "1") != "0"


def video_dir_allowlist(environ: Mapping[str, str] | None = None) -> str | None:
    """`MLXCEL_VIDEO_DIR_ALLOWLIST` as given (None when unset or empty)."""
    return _text(VIDEO_DIR_ALLOWLIST, environ)


def request_memory_budget(environ: Mapping[str, str] | None = None) -> str | None:
    """`MLXCEL_REQUEST_MEMORY_BUDGET` as given (None when unset or empty)."""
    return _text(REQUEST_MEMORY_BUDGET, environ)


def model_store() -> Path | None:
    """`$MLXCEL_MODEL_STORE` (user-expanded); None when unset or empty."""
    chosen = _text(MODEL_STORE)
    return Path(chosen).expanduser() if chosen else None


def prompt_cache_dir() -> Path | None:
    """`$MLXCEL_PROMPT_CACHE_DIR` (user-expanded); None when unset or empty."""
    chosen = _text(PROMPT_CACHE_DIR)
    return Path(chosen).expanduser() if chosen else None


def loop_detection() -> str | None:
    """`MLXCEL_LOOP_DETECTION` as given (None when unset or empty)."""
    return _text(LOOP_DETECTION)


def audio_model() -> str | None:
    """`MLXCEL_AUDIO_MODEL`, `mlxcel transcribe`'s default model (None when unset or empty)."""
    return _text(AUDIO_MODEL)


def tts_model() -> str | None:
    """`MLXCEL_TTS_MODEL`, `mlxcel speak`'s default model (None when unset or empty)."""
    return _text(TTS_MODEL)
