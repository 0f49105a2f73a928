"""The typed settings model: one field per setting, with its env var, group and help.

Each field carries its metadata in `json_schema_extra` (`env`: the environment variable,
`group`: the profile table it is saved under); its help text is the field description.
`field_meta()` exposes that metadata so that the env reader, the profile writer, the
`mlxcel serve` parser and the generated docs all read the same single source. The CLI
spellings of a field live in the flag table (`mlxcel.config.llama_flags`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict

GROUPS: tuple[str, ...] = ("model", "chat", "sampling", "server", "logging")
"""Profile tables, in the order they are written."""

DEFAULT_DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")


class SettingsError(ValueError):
    """A bad setting: unknown key, malformed value, missing profile. The message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split("\n")).strip())


def _f(default: Any = None, help: str = "", *, env: str, group: str, **kw: Any) -> Any:
    """A field with its env var and profile group attached."""
    extra: JsonDict = {"env": env, "group": group}
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=extra, **kw)
    return Field(default, description=help, json_schema_extra=extra, **kw)


_BOOL_WORDS = {
    "1": True,
    "true": True,
    "on": True,
    "yes": True,
    "enabled": True,
    "enable": True,
    "0": False,
    "false": False,
    "off": False,
    "no": False,
    "disabled": False,
    "disable": False,
}


class Settings(BaseModel):
    """Every mlxcel setting, with llama-server's names and defaults where one exists."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- model -------------------------------------------------------------------------
    model: str | None = _f(
        None,
        "Model: a .gguf file, an MLX directory or a cached HF repo id; default: built-in",
        env="LLAMA_ARG_MODEL",
        group="model",
    )
    alias: str | None = _f(
        None,
        "Model names reported by the API, comma-separated (the first, sorted, is the main one)",
        env="LLAMA_ARG_ALIAS",
        group="model",
    )
    tags: str | None = _f(
        None,
        "Model tags for /v1/models, comma-separated (informational)",
        env="LLAMA_ARG_TAGS",
        group="model",
    )
    model_store: str | None = _f(
        None, "Directory for converted models", env="MLXCEL_MODEL_STORE", group="model"
    )
    cpu_dtype: Literal["auto", "float32", "keep"] = _f(
        "auto",
        "Quantized weights on the CPU backend (auto: mlxcel's kernel + float32 prefill copy)",
        env="MLXCEL_CPU_DTYPE",
        group="model",
    )
    cache_type_k: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = _f(
        "f16",
        "KV cache type of the keys (q8_0/q4_0: 8/4 bits in groups of 32); the same as -ctv",
        env="LLAMA_ARG_CACHE_TYPE_K",
        group="model",
    )
    cache_type_v: Literal["f32", "f16", "bf16", "q8_0", "q4_0"] = _f(
        "f16",
        "KV cache type of the values; the same as -ctk",
        env="LLAMA_ARG_CACHE_TYPE_V",
        group="model",
    )
    threads: int = _f(
        -1,
        "CPU threads for mlxcel's CPU kernel (-1: one per core, at most 8)",
        env="LLAMA_ARG_THREADS",
        group="model",
        ge=-1,
    )
    warmup: bool = _f(
        True, "Run one warm-up step after loading", env="MLXCEL_WARMUP", group="model"
    )
    distributed: bool = _f(
        False,
        "Run as one rank of a group started by mlx.launch even when MLX reports one rank "
        "(a group of several ranks is detected without it)",
        env="MLXCEL_DISTRIBUTED",
        group="model",
    )
    pipeline: bool = _f(
        False,
        "In a group of ranks, split the model's layers across the ranks (pipeline parallel) "
        "instead of each layer's weights (tensor parallel)",
        env="MLXCEL_PIPELINE",
        group="model",
    )
    distributed_timeout: float = _f(
        60.0,
        "Seconds rank 0 waits on the other ranks in one step before it declares the group "
        "broken (/health 503, requests refused)",
        env="MLXCEL_DISTRIBUTED_TIMEOUT",
        group="model",
        gt=0.0,
    )
    embedding: bool = _f(False, "Serve embeddings only", env="LLAMA_ARG_EMBEDDINGS", group="model")
    reranking: bool = _f(False, "Serve reranking", env="LLAMA_ARG_RERANKING", group="model")
    embedding_model: str | None = _f(
        None,
        "Embedding model loaded as a side worker next to the chat model",
        env="MLXCEL_EMBEDDING_MODEL",
        group="model",
    )
    reranker_model: str | None = _f(
        None,
        "Reranker model loaded as a side worker next to the chat model",
        env="MLXCEL_RERANKER_MODEL",
        group="model",
    )
    audio_model: str | None = _f(
        None,
        "Whisper model for /v1/audio/transcriptions (tiny.en: the shipped one)",
        env="MLXCEL_AUDIO_MODEL",
        group="model",
    )
    tts_model: str | None = _f(
        None, "Kokoro model dir for /v1/audio/speech", env="MLXCEL_TTS_MODEL", group="model"
    )
    image_model: str | None = _f(
        None,
        "Image model dir (Z-Image, FLUX.2-klein) for mlxcel image and /v1/images",
        env="MLXCEL_IMAGE_MODEL",
        group="model",
    )
    pooling: Literal["none", "mean", "cls", "last", "rank"] | None = _f(
        None, "Embedding pooling; default: the model's", env="LLAMA_ARG_POOLING", group="model"
    )
    embd_normalize: int = _f(
        2,
        "Embedding normalization (-1 none, 0 max abs, 1 taxicab, 2 euclidean, >2 p-norm)",
        env="MLXCEL_EMBD_NORMALIZE",
        group="model",
        ge=-1,
    )

    # --- chat --------------------------------------------------------------------------
    chat_template: str | None = _f(
        None,
        "Chat template (Jinja text or a built-in name)",
        env="LLAMA_ARG_CHAT_TEMPLATE",
        group="chat",
    )
    chat_template_file: str | None = _f(
        None, "File holding the chat template", env="LLAMA_ARG_CHAT_TEMPLATE_FILE", group="chat"
    )
    chat_template_kwargs: dict[str, Any] = _f(
        dict,
        "Extra template variables (a JSON object)",
        env="LLAMA_ARG_CHAT_TEMPLATE_KWARGS",
        group="chat",
    )
    jinja: bool = _f(True, "Use the Jinja chat template", env="LLAMA_ARG_JINJA", group="chat")
    no_chat_template: bool = _f(
        False,
        "Never apply a chat template (raw prompts)",
        env="MLXCEL_NO_CHAT_TEMPLATE",
        group="chat",
    )
    reasoning_format: Literal["auto", "none", "deepseek", "deepseek-legacy"] = _f(
        "auto",
        "Where reasoning text goes: auto, none, deepseek, deepseek-legacy",
        env="LLAMA_ARG_THINK",
        group="chat",
    )
    reasoning_budget: int = _f(
        -1,
        "Thinking budget in tokens (-1 unlimited, 0 off)",
        env="LLAMA_ARG_THINK_BUDGET",
        group="chat",
        ge=-1,
    )
    reasoning: Literal["on", "off", "auto"] = _f(
        "auto",
        "Thinking in chat: on, off (templates get enable_thinking=false, no reasoning split) "
        "or auto (the template decides)",
        env="LLAMA_ARG_REASONING",
        group="chat",
    )
    spec_type: Literal["none", "ngram-simple", "draft-simple"] = _f(
        "none",
        "Speculative decoding: none, ngram-simple (prompt lookup), draft-simple (draft model)",
        env="LLAMA_ARG_SPEC_TYPE",
        group="sampling",
    )
    spec_draft_model: str | None = _f(
        None,
        "Draft model for speculative decoding (implies --spec-type draft-simple)",
        env="LLAMA_ARG_SPEC_DRAFT_MODEL",
        group="model",
    )
    spec_draft_n_max: int = _f(
        3,
        "Most tokens drafted per verify round",
        env="LLAMA_ARG_SPEC_DRAFT_N_MAX",
        group="sampling",
        ge=1,
        le=64,
    )
    spec_draft_n_min: int = _f(
        0,
        "Fewest drafted tokens worth a verify round",
        env="LLAMA_ARG_SPEC_DRAFT_N_MIN",
        group="sampling",
        ge=0,
    )
    special: bool = _f(False, "Output special tokens", env="MLXCEL_SPECIAL", group="chat")

    # --- sampling ----------------------------------------------------------------------
    temp: float = _f(0.8, "Temperature (0 = greedy)", env="MLXCEL_TEMP", group="sampling")
    top_k: int = _f(40, "Top-k (0 = off)", env="LLAMA_ARG_TOP_K", group="sampling", ge=0)
    top_p: float = _f(
        0.95, "Top-p (1.0 = off)", env="MLXCEL_TOP_P", group="sampling", ge=0.0, le=1.0
    )
    min_p: float = _f(
        0.05, "Min-p (0.0 = off)", env="MLXCEL_MIN_P", group="sampling", ge=0.0, le=1.0
    )
    repeat_penalty: float = _f(
        1.0, "Repetition penalty (1.0 = off)", env="MLXCEL_REPEAT_PENALTY", group="sampling", ge=0.0
    )
    repeat_last_n: int = _f(
        64,
        "Tokens considered for penalties (0 off, -1 context)",
        env="MLXCEL_REPEAT_LAST_N",
        group="sampling",
        ge=-1,
    )
    presence_penalty: float = _f(
        0.0, "Presence penalty (0.0 = off)", env="MLXCEL_PRESENCE_PENALTY", group="sampling"
    )
    frequency_penalty: float = _f(
        0.0, "Frequency penalty (0.0 = off)", env="MLXCEL_FREQUENCY_PENALTY", group="sampling"
    )
    dry_multiplier: float = _f(
        0.0, "DRY multiplier (0.0 = off)", env="MLXCEL_DRY_MULTIPLIER", group="sampling", ge=0.0
    )
    dry_base: float = _f(1.75, "DRY base", env="MLXCEL_DRY_BASE", group="sampling", ge=0.0)
    dry_allowed_length: int = _f(
        2, "DRY allowed length", env="MLXCEL_DRY_ALLOWED_LENGTH", group="sampling", ge=0
    )
    dry_penalty_last_n: int = _f(
        -1,
        "DRY window (0 off, -1 context)",
        env="MLXCEL_DRY_PENALTY_LAST_N",
        group="sampling",
        ge=-1,
    )
    dry_sequence_breaker: list[str] = _f(
        lambda: list(DEFAULT_DRY_SEQUENCE_BREAKERS),
        "DRY sequence breakers (as text: one breaker, a JSON list, or 'none')",
        env="MLXCEL_DRY_SEQUENCE_BREAKER",
        group="sampling",
    )
    xtc_probability: float = _f(
        0.0,
        "XTC probability (0.0 = off)",
        env="MLXCEL_XTC_PROBABILITY",
        group="sampling",
        ge=0.0,
        le=1.0,
    )
    xtc_threshold: float = _f(
        0.1, "XTC threshold", env="MLXCEL_XTC_THRESHOLD", group="sampling", ge=0.0, le=1.0
    )
    top_n_sigma: float = _f(
        -1.0,
        "Top-n-sigma: keep logits within n standard deviations of the top one (<= 0 = off)",
        env="MLXCEL_TOP_N_SIGMA",
        group="sampling",
    )
    typical_p: float = _f(
        1.0,
        "Locally typical sampling, p (1.0 = off)",
        env="MLXCEL_TYPICAL_P",
        group="sampling",
        gt=0.0,
        le=1.0,
    )
    dynatemp_range: float = _f(
        0.0,
        "Dynamic temperature range: temp +/- range by the entropy (0.0 = off)",
        env="MLXCEL_DYNATEMP_RANGE",
        group="sampling",
        ge=0.0,
    )
    dynatemp_exponent: float = _f(
        1.0,
        "Dynamic temperature exponent",
        env="MLXCEL_DYNATEMP_EXPONENT",
        group="sampling",
        ge=0.0,
    )
    mirostat: int = _f(
        0,
        "Mirostat sampling: 0 off, 1 Mirostat, 2 Mirostat 2.0 (replaces top-k to XTC)",
        env="MLXCEL_MIROSTAT",
        group="sampling",
        ge=0,
        le=2,
    )
    mirostat_tau: float = _f(
        5.0,
        "Mirostat target entropy (tau)",
        env="MLXCEL_MIROSTAT_TAU",
        group="sampling",
        ge=0.0,
    )
    mirostat_eta: float = _f(
        0.1,
        "Mirostat learning rate (eta)",
        env="MLXCEL_MIROSTAT_ETA",
        group="sampling",
        ge=0.0,
    )
    adaptive_target: float = _f(
        -1.0,
        "Adaptive-p: the probability the drawn tokens should average (negative = off)",
        env="MLXCEL_ADAPTIVE_TARGET",
        group="sampling",
        le=1.0,
    )
    adaptive_decay: float = _f(
        0.9,
        "Adaptive-p: decay of its running average of drawn probabilities (at most 0.99 used)",
        env="MLXCEL_ADAPTIVE_DECAY",
        group="sampling",
        ge=0.0,
        le=1.0,
    )
    seed: int = _f(-1, "RNG seed (-1 = random)", env="MLXCEL_SEED", group="sampling", ge=-1)
    n_predict: int = _f(
        -1,
        "Tokens to generate (-1 = until done)",
        env="LLAMA_ARG_N_PREDICT",
        group="sampling",
        ge=-2,
    )
    ignore_eos: bool = _f(
        False, "Keep generating past end-of-sequence", env="MLXCEL_IGNORE_EOS", group="sampling"
    )
    loop_detection: str | None = _f(
        None,
        "Loop detection spec (parsed by the engine)",
        env="MLXCEL_LOOP_DETECTION",
        group="sampling",
    )
    grammar_backend: Literal["llguidance", "xgrammar"] = _f(
        "llguidance", "Structured-output backend", env="MLXCEL_GRAMMAR_BACKEND", group="sampling"
    )

    # --- server ------------------------------------------------------------------------
    host: str = _f("127.0.0.1", "Address to listen on", env="LLAMA_ARG_HOST", group="server")
    port: int = _f(
        8080,
        "Port to listen on (0 = any free port)",
        env="LLAMA_ARG_PORT",
        group="server",
        ge=0,
        le=65535,
    )
    ctx_size: int = _f(
        0, "Context size (0 = from the model)", env="LLAMA_ARG_CTX_SIZE", group="server", ge=0
    )
    parallel: int = _f(
        -1, "Number of slots (-1 = auto)", env="LLAMA_ARG_N_PARALLEL", group="server", ge=-1
    )
    kv_unified: bool | None = _f(
        None,
        "One KV pool of --ctx-size tokens shared by all slots, each slot may use all of it "
        "(unset: on when --parallel is auto)",
        env="LLAMA_ARG_KV_UNIFIED",
        group="server",
    )
    batch_size: int = _f(2048, "Logical batch size", env="LLAMA_ARG_BATCH", group="server", ge=1)
    ubatch_size: int = _f(512, "Prefill chunk size", env="LLAMA_ARG_UBATCH", group="server", ge=1)
    api_key: list[str] = _f(
        list, "API keys (as text: comma-separated)", env="LLAMA_API_KEY", group="server"
    )
    api_key_file: str | None = _f(
        None, "File with API keys, one per line", env="LLAMA_ARG_API_KEY_FILE", group="server"
    )
    timeout: int = _f(
        3600, "Read/write timeout in seconds", env="LLAMA_ARG_TIMEOUT", group="server", ge=0
    )
    metrics: bool = _f(
        False, "Enable the /metrics endpoint", env="LLAMA_ARG_ENDPOINT_METRICS", group="server"
    )
    metrics_port: int | None = _f(
        None,
        "Serve /metrics on this port too",
        env="MLXCEL_METRICS_PORT",
        group="server",
        ge=0,
        le=65535,
    )
    slots: bool = _f(
        True, "Enable the /slots endpoint", env="LLAMA_ARG_ENDPOINT_SLOTS", group="server"
    )
    props: bool = _f(False, "Allow POST /props", env="LLAMA_ARG_ENDPOINT_PROPS", group="server")
    cache_prompt: bool = _f(
        True, "Reuse the KV cache of earlier prompts", env="LLAMA_ARG_CACHE_PROMPT", group="server"
    )
    cache_ram: int = _f(
        8192,
        "Prompt cache RAM limit in MiB (-1 none, 0 off)",
        env="LLAMA_ARG_CACHE_RAM",
        group="server",
        ge=-1,
    )
    cache_ttl_secs: int = _f(
        3600,
        "Drop prompt-cache entries unused this long",
        env="MLXCEL_CACHE_TTL_SECS",
        group="server",
        ge=0,
    )
    ssl_key_file: str | None = _f(
        None, "PEM private key for HTTPS", env="LLAMA_ARG_SSL_KEY_FILE", group="server"
    )
    ssl_cert_file: str | None = _f(
        None, "PEM certificate for HTTPS", env="LLAMA_ARG_SSL_CERT_FILE", group="server"
    )
    cors_origins: str = _f(
        "*", "Allowed CORS origins", env="LLAMA_ARG_CORS_ORIGINS", group="server"
    )
    cors_methods: str = _f(
        "GET, POST, DELETE, OPTIONS",
        "Allowed CORS methods",
        env="LLAMA_ARG_CORS_METHODS",
        group="server",
    )
    cors_headers: str = _f(
        "*", "Allowed CORS headers", env="LLAMA_ARG_CORS_HEADERS", group="server"
    )
    cors_credentials: bool = _f(
        True, "Allow CORS credentials", env="LLAMA_ARG_CORS_CREDENTIALS", group="server"
    )
    api_prefix: str = _f("", "Prefix for every route", env="LLAMA_ARG_API_PREFIX", group="server")
    media_path: str | None = _f(
        None,
        "Directory that file:// media may be read from",
        env="MLXCEL_MEDIA_PATH",
        group="server",
    )
    prompt_cache_dir: str | None = _f(
        None,
        "Disk tier of the prompt cache: prefixes evicted from RAM or held at shutdown are "
        "kept there for later runs of the same model and KV type (unset: RAM only)",
        env="MLXCEL_PROMPT_CACHE_DIR",
        group="server",
    )
    prompt_cache_disk_mib: int = _f(
        4096,
        "Size bound of the prompt cache's disk tier in MiB (least recently used go first)",
        env="MLXCEL_PROMPT_CACHE_DISK_MIB",
        group="server",
        ge=1,
    )
    slot_save_path: str | None = _f(
        None,
        "Directory for POST /slots/{id}?action=save|restore files (unset: slots cannot be saved)",
        env="MLXCEL_SLOT_SAVE_PATH",
        group="server",
    )
    video_max_frames: int = _f(
        8,
        "Frames sampled from a video for vision models without a native video path",
        env="MLXCEL_VIDEO_MAX_FRAMES",
        group="server",
        ge=1,
        le=256,
    )
    responses_store_max_entries: int = _f(
        1024,
        "Stored /v1/responses answers (0 = no storing)",
        env="LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES",
        group="server",
        ge=0,
    )
    responses_store_ttl_secs: int = _f(
        3600,
        "Seconds a stored response is kept",
        env="LLAMA_ARG_RESPONSES_STORE_TTL_SECS",
        group="server",
        ge=0,
    )
    conversation_store_max_entries: int = _f(
        256,
        "Stored Responses conversations (0 = no storing)",
        env="LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES",
        group="server",
        ge=0,
    )
    conversation_store_ttl_secs: int = _f(
        3600,
        "Seconds a stored conversation is kept",
        env="LLAMA_ARG_CONVERSATION_STORE_TTL_SECS",
        group="server",
        ge=0,
    )
    max_queue_depth: int = _f(
        64, "Waiting requests before 503", env="MLXCEL_MAX_QUEUE_DEPTH", group="server", ge=0
    )
    max_connections: int = _f(
        0,
        "Open connections served at once; past it /health still answers, others get 503"
        " (0 = auto: half the open-file limit, at most 4096)",
        env="MLXCEL_MAX_CONNECTIONS",
        group="server",
        ge=0,
    )
    models_dir: str | None = _f(
        None,
        "Router mode (no -m): serve every model in this directory, loaded on demand",
        env="LLAMA_ARG_MODELS_DIR",
        group="server",
    )
    models_preset: str | None = _f(
        None,
        "Router mode (no -m): an INI file of models and their options ([*] for all)",
        env="LLAMA_ARG_MODELS_PRESET",
        group="server",
    )
    models_max: int = _f(
        4,
        "Router mode: models loaded at once; the least recently used is unloaded (0 = no limit)",
        env="LLAMA_ARG_MODELS_MAX",
        group="server",
        ge=0,
    )
    models_autoload: bool = _f(
        True,
        "Router mode: load a model on its first request (off: only POST /models/load)",
        env="LLAMA_ARG_MODELS_AUTOLOAD",
        group="server",
    )
    sleep_idle_seconds: int = _f(
        -1,
        "Seconds without a request after which the model is unloaded until the next one"
        " (-1 = never)",
        env="MLXCEL_SLEEP_IDLE_SECONDS",
        group="server",
        ge=-1,
    )
    audio_queue_depth: int = _f(
        8, "Audio requests waiting before 503", env="MLXCEL_AUDIO_QUEUE_DEPTH", group="server", ge=1
    )
    audio_timeout: float = _f(
        600.0,
        "Seconds an audio request may take before 504 (0 = none)",
        env="MLXCEL_AUDIO_TIMEOUT",
        group="server",
        ge=0,
    )
    image_queue_depth: int = _f(
        4, "Image requests waiting before 503", env="MLXCEL_IMAGE_QUEUE_DEPTH", group="server", ge=1
    )
    image_timeout: float = _f(
        600.0,
        "Seconds an image request may take before 504 (0 = none)",
        env="MLXCEL_IMAGE_TIMEOUT",
        group="server",
        ge=0,
    )
    realtime_max_sessions: int = _f(
        4,
        "Open /v1/realtime voice sessions at once; more are closed with 1013 (try again)",
        env="MLXCEL_REALTIME_MAX_SESSIONS",
        group="server",
        ge=1,
    )
    realtime_idle_timeout: float = _f(
        300.0,
        "Seconds a /v1/realtime session may stay silent before it is closed (0 = never)",
        env="MLXCEL_REALTIME_IDLE_TIMEOUT",
        group="server",
        ge=0,
    )
    realtime_max_audio_seconds: float = _f(
        120.0,
        "Seconds of audio a /v1/realtime input buffer holds; more is refused with an error",
        env="MLXCEL_REALTIME_MAX_AUDIO_SECONDS",
        group="server",
        gt=0,
    )
    embedding_batch_size: int = _f(
        32, "Inputs per embedding batch", env="MLXCEL_EMBEDDING_BATCH_SIZE", group="server", ge=1
    )
    embedding_queue_depth: int = _f(
        64,
        "Waiting embedding/rerank requests before 503",
        env="MLXCEL_EMBEDDING_QUEUE_DEPTH",
        group="server",
        ge=1,
    )
    embedding_timeout: float = _f(
        600.0,
        "Seconds an embedding/rerank request may take before 504 (0 = none)",
        env="MLXCEL_EMBEDDING_TIMEOUT",
        group="server",
        ge=0,
    )
    embedding_max_inputs: int = _f(
        2048,
        "Most inputs in one embedding/rerank request",
        env="MLXCEL_EMBEDDING_MAX_INPUTS",
        group="server",
        ge=1,
    )
    max_body_size: int = _f(
        8 * 1024 * 1024,
        "Largest request body in bytes",
        env="MLXCEL_MAX_BODY_SIZE",
        group="server",
        ge=1,
    )
    sse_ping_interval: int = _f(
        30,
        "Seconds between SSE keep-alive pings (0 = off)",
        env="LLAMA_ARG_SSE_PING_INTERVAL",
        group="server",
        ge=0,
    )

    # --- logging -----------------------------------------------------------------------
    log_file: str | None = _f(
        None, "Also log to this file", env="LLAMA_ARG_LOG_FILE", group="logging"
    )
    log_colors: Literal["on", "off", "auto"] = _f(
        "auto", "Colored logs: on, off, auto", env="LLAMA_ARG_LOG_COLORS", group="logging"
    )
    log_verbosity: int = _f(
        3, "Log verbosity (higher = more)", env="LLAMA_ARG_LOG_VERBOSITY", group="logging", ge=0
    )
    log_prefix: bool = _f(False, "Prefix log lines", env="LLAMA_ARG_LOG_PREFIX", group="logging")
    log_timestamps: bool = _f(
        False, "Timestamp log lines", env="LLAMA_ARG_LOG_TIMESTAMPS", group="logging"
    )
    log_disable: bool = _f(False, "Disable logging", env="MLXCEL_LOG_DISABLE", group="logging")
    verbose: bool = _f(False, "Log everything", env="MLXCEL_VERBOSE", group="logging")

    @field_validator("log_colors", mode="before")
    @classmethod
    def _log_colors_word(cls, value: Any) -> Any:
        """Accept booleans and llama.cpp's on/off spellings for log_colors."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
            return "on" if _BOOL_WORDS[value.strip().lower()] else "off"
        return value

    @field_validator("reasoning", mode="before")
    @classmethod
    def _reasoning_word(cls, value: Any) -> Any:
        """llama.cpp's spellings for --reasoning: on/off words, booleans, auto or -1."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, (str, int)):
            text = str(value).strip().lower()
            if text in ("auto", "-1"):
                return "auto"
            if text in _BOOL_WORDS:
                return "on" if _BOOL_WORDS[text] else "off"
        return value

    @model_validator(mode="after")
    def _reasoning_defaults(self) -> Settings:
        """`reasoning` on/off becomes the server's default `enable_thinking` template
        variable (a value set in `chat_template_kwargs` wins), as llama-server does; with
        thinking off, reasoning text is not split out (`reasoning_format` none).

        Only changed values are assigned, so re-validation on assignment ends at once.
        """
        if self.reasoning == "auto":
            return self
        kwargs = dict(self.chat_template_kwargs)
        kwargs.setdefault("enable_thinking", self.reasoning == "on")
        if kwargs != self.chat_template_kwargs:
            self.chat_template_kwargs = kwargs
        if kwargs["enable_thinking"] is False and self.reasoning_format != "none":
            self.reasoning_format = "none"
        return self

    @field_validator("sleep_idle_seconds")
    @classmethod
    def _sleep_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (never sleep) or at least 1")
        return value

    @field_validator("parallel")
    @classmethod
    def _parallel_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (auto) or at least 1")
        return value

    def alias_names(self) -> list[str]:
        """`alias` split at commas: distinct names, sorted (llama-server keeps a set)."""
        return _name_set(self.alias)

    def tag_names(self) -> list[str]:
        """`tags` split at commas: distinct tags, sorted."""
        return _name_set(self.tags)

    def api_keys(self) -> list[str]:
        """Every accepted API key: `api_key` plus the lines of `api_key_file` (read now)."""
        keys = list(self.api_key)
        if self.api_key_file:
            text = Path(self.api_key_file).expanduser().read_text(encoding="utf-8")
            keys.extend(line.strip() for line in text.splitlines() if line.strip())
        return list(dict.fromkeys(keys))


def _name_set(text: str | None) -> list[str]:
    return sorted({part.strip() for part in (text or "").split(",") if part.strip()})


@dataclass(frozen=True)
class FieldMeta:
    """What the rest of the config layer knows about one settings field."""

    name: str
    env: str
    group: str
    help: str
    default: Any
    annotation: Any


@functools.cache
def _all_meta() -> dict[str, FieldMeta]:
    out: dict[str, FieldMeta] = {}
    for name, info in Settings.model_fields.items():
        extra = info.json_schema_extra
        assert isinstance(extra, dict), name
        out[name] = FieldMeta(
            name=name,
            env=str(extra["env"]),
            group=str(extra["group"]),
            help=info.description or "",
            default=info.get_default(call_default_factory=True),
            annotation=info.annotation,
        )
    return out


def field_meta(name: str) -> FieldMeta:
    """Metadata of field `name` (SettingsError when there is no such field)."""
    try:
        return _all_meta()[name]
    except KeyError:
        raise SettingsError(f"unknown setting '{name}'") from None


def all_field_meta() -> dict[str, FieldMeta]:
    """Metadata of every field, in declaration order."""
    return dict(_all_meta())


def field_names() -> list[str]:
    """Every settings field, in declaration order."""
    return list(_all_meta())


def parse_bool(text: str) -> bool | None:
    """llama.cpp's boolean spellings (1/0, true/false, on/off, enabled/disabled, yes/no)."""
    return _BOOL_WORDS.get(text.strip().lower())


def validate_values(values: dict[str, Any], label: Callable[[str], str]) -> dict[str, Any]:
    """Check a partial set of field values; return them coerced to their field types.

    `label(field)` names where a value came from (an env var, a profile key, a flag);
    the first problem becomes a one-line SettingsError naming it.
    """
    meta = _all_meta()
    for key in values:
        if key not in meta:
            close = difflib.get_close_matches(key, list(meta), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise SettingsError(f"{label(key)}: unknown key '{key}'{hint}")
    try:
        checked = Settings.model_validate(values)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        msg = str(err["msg"]).removeprefix("Value error, ")
        msg = msg[:1].lower() + msg[1:]
        got = values.get(key, err.get("input"))
        raise SettingsError(f"{label(key)}: {msg} (got {got!r})") from None
    for key, value in values.items():
        kept = getattr(checked, key)
        # Pydantic's lax mode reads True as 1 and 1.0: a profile's `n_predict = true`.
        if isinstance(value, bool) and not isinstance(kept, bool):
            kind = {int: "an integer", float: "a number"}.get(type(kept), type(kept).__name__)
            raise SettingsError(f"{label(key)}: expected {kind}, got {str(value).lower()}")
    return {key: getattr(checked, key) for key in values}
