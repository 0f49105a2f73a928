"""The llama-server option table and the `mlxcel serve` argv parser.

`FLAGS` has one entry per row of llama-server's option list (llama.cpp 34af94cd9), with
every spelling, its environment variable and default, and a deliberate status:

- `supported`: maps to a `Settings` field (or to an action such as `--help`);
- `ignored`: accepted with a one-line warning, because it has no meaning under MLX
  (threads, GPU offload, memory mapping, KV cache types, web UI, ...);
- `refused`: a one-line error, because ignoring it would silently change results
  (adapters, RoPE overrides, downloads, server-wide grammars, unimplemented samplers, ...).
  Some refused rows accept their "off" value (`--mirostat 0`) or spelling
  (`--no-context-shift`), which change nothing, as ignored.

mlxcel's own options follow in the same table (section `mlxcel options`). To support an
option, change its spec to `sup("field_name")` (and add the field to `Settings`): the parser,
`serve_help()` and the generated docs follow from the table. Help text, env var and default of
a supported option come from the `Settings` field.
"""

from __future__ import annotations

import difflib
import json
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mlxcel.config.env import is_text_field, parse_text
from mlxcel.config.settings import SettingsError, field_meta, parse_bool, validate_values


class Status(str, Enum):
    """What `mlxcel serve` does with an option."""

    SUPPORTED = "supported"
    IGNORED = "ignored"
    REFUSED = "refused"


@dataclass(frozen=True)
class Spec:
    """The status of one option row and what it maps to."""

    status: Status
    field: str | None = None
    action: str | None = None
    note: str = ""
    noop: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()


def sup(field_name: str, note: str = "") -> Spec:
    """Supported: the option sets the settings field `field_name`."""
    return Spec(Status.SUPPORTED, field=field_name, note=note)


def act(action: str, note: str = "") -> Spec:
    """Supported: the option triggers `action` (help, version, profile)."""
    return Spec(Status.SUPPORTED, action=action, note=note)


def ign(note: str) -> Spec:
    """Ignored: accepted with a warning that gives `note`."""
    return Spec(Status.IGNORED, note=note)


def ref(note: str, *, noop: tuple[str, ...] = (), allow: tuple[str, ...] = ()) -> Spec:
    """Refused with `note`, except `noop` values and `allow` spellings (ignored instead)."""
    return Spec(Status.REFUSED, note=note, noop=noop, allow=allow)


_COMMON = "Common params"
_SAMPLING = "Sampling params"
_SERVER = "Server-specific params"
_MLXCEL = "mlxcel options"

_THREADS = "CPU threads, affinity and priority: MLX schedules its own work"
_OFFLOAD = "device placement and offload: MLX uses one device with unified memory"
_MEMORY = "llama.cpp weight loading and locking: MLX manages weight memory itself"
_KV_TYPE = "draft KV cache types: the draft model keeps its cache in its own dtype"
_CACHE = "llama.cpp KV cache internals: mlxcel has its own prompt cache"
_UI = "mlxcel serves no web UI or static files"
_ROPE = "RoPE/YaRN overrides are not supported; mlxcel uses the model's own settings"
_ADAPTERS = "adapters (LoRA, control vectors) are not supported"
_DOWNLOAD = "mlxcel never downloads models; pass a local file, directory or cached repo with -m"
_PRESET = "presets download models; mlxcel never downloads (use -m)"
_SPEC = "speculative-decoding presets are not supported"
_SPEC_TUNE = "tunes speculative decoding, which is not supported yet"
_MULTIMODAL = (
    "GGUF multimodal projectors are not supported (mlx-vlm cannot load them); "
    "pass an MLX vision model directory with -m instead"
)
_TOOLS = "built-in server tools, MCP and agent mode are not supported"

# fmt: off
# One row per option, the spec on its own line
# (section, spellings and value as llama-server prints them, env var, default, spec)
_ROWS: tuple[tuple[str, str, str, str, Spec], ...] = (
    (_COMMON, "-h, --help, --usage", "", "",
        act("help", "Show this help and exit")),
    (_COMMON, "--version", "", "",
        act("version", "Print the version and exit")),
    (_COMMON, "-cl, --cache-list", "", "",
        ref("the llama.cpp model cache listing is not available; see `mlxcel cache`")),
    (_COMMON, "--completion-bash", "", "",
        ref("use `mlxcel --install-completion`")),
    (_COMMON, "-t, --threads N", "LLAMA_ARG_THREADS", "-1",
        sup("threads", "threads of mlxcel's CPU kernel (quantized matmuls on the CPU)")),
    (_COMMON, "-tb, --threads-batch N", "", "same as --threads",
        ign(_THREADS)),
    (_COMMON, "-C, --cpu-mask M", "", "\"\"",
        ign(_THREADS)),
    (_COMMON, "-Cr, --cpu-range lo-hi", "", "",
        ign(_THREADS)),
    (_COMMON, "--cpu-strict <0|1>", "", "0",
        ign(_THREADS)),
    (_COMMON, "--prio N", "", "0",
        ign(_THREADS)),
    (_COMMON, "--poll <0...100>", "", "50",
        ign(_THREADS)),
    (_COMMON, "-Cb, --cpu-mask-batch M", "", "same as --cpu-mask",
        ign(_THREADS)),
    (_COMMON, "-Crb, --cpu-range-batch lo-hi", "", "",
        ign(_THREADS)),
    (_COMMON, "--cpu-strict-batch <0|1>", "", "same as --cpu-strict",
        ign(_THREADS)),
    (_COMMON, "--prio-batch N", "", "0",
        ign(_THREADS)),
    (_COMMON, "--poll-batch <0|1>", "", "same as --poll",
        ign(_THREADS)),
    (_COMMON, "-c, --ctx-size N", "LLAMA_ARG_CTX_SIZE", "0, 0 = loaded from model",
        sup("ctx_size")),
    (_COMMON, "-n, --predict, --n-predict N", "LLAMA_ARG_N_PREDICT", "-1, -1 = infinity",
        sup("n_predict")),
    (_COMMON, "-b, --batch-size N", "LLAMA_ARG_BATCH", "2048",
        sup("batch_size")),
    (_COMMON, "-ub, --ubatch-size N", "LLAMA_ARG_UBATCH", "512",
        sup("ubatch_size")),
    (_COMMON, "--keep N", "", "0, -1 = all",
        ign("there is no context shift, so nothing to keep")),
    (_COMMON, "--swa-full", "LLAMA_ARG_SWA_FULL", "false",
        ign("sliding-window caches are sized by mlxcel")),
    (_COMMON, "-fa, --flash-attn [on|off|auto]", "LLAMA_ARG_FLASH_ATTN", "'auto'",
        ign("MLX chooses its attention kernel itself")),
    (_COMMON, "--perf, --no-perf", "LLAMA_ARG_PERF", "false",
        ign("llama.cpp timing output; see /metrics")),
    (_COMMON, "-e, --escape, --no-escape", "", "true",
        ign("escapes apply to command-line prompts; the server has none")),
    (_COMMON, "--rope-scaling {none,linear,yarn}", "LLAMA_ARG_ROPE_SCALING_TYPE", "",
        ref(_ROPE, noop=("none",))),
    (_COMMON, "--rope-scale N", "LLAMA_ARG_ROPE_SCALE", "",
        ref(_ROPE)),
    (_COMMON, "--rope-freq-base N", "LLAMA_ARG_ROPE_FREQ_BASE", "loaded from model",
        ref(_ROPE)),
    (_COMMON, "--rope-freq-scale N", "LLAMA_ARG_ROPE_FREQ_SCALE", "",
        ref(_ROPE)),
    (_COMMON, "--yarn-orig-ctx N", "LLAMA_ARG_YARN_ORIG_CTX", "0 = model training context size",
        ref(_ROPE)),
    (_COMMON, "--yarn-ext-factor N", "LLAMA_ARG_YARN_EXT_FACTOR", "-1.00, 0.0 = full interpolation",
        ref(_ROPE)),
    (_COMMON, "--yarn-attn-factor N", "LLAMA_ARG_YARN_ATTN_FACTOR", "-1.00",
        ref(_ROPE)),
    (_COMMON, "--yarn-beta-slow N", "LLAMA_ARG_YARN_BETA_SLOW", "-1.00",
        ref(_ROPE)),
    (_COMMON, "--yarn-beta-fast N", "LLAMA_ARG_YARN_BETA_FAST", "-1.00",
        ref(_ROPE)),
    (_COMMON, "-kvo, --kv-offload, -nkvo, --no-kv-offload", "LLAMA_ARG_KV_OFFLOAD", "enabled",
        ign(_OFFLOAD)),
    (_COMMON, "--repack, -nr, --no-repack", "LLAMA_ARG_REPACK", "enabled",
        ign("weight repacking is a llama.cpp CPU-backend detail")),
    (_COMMON, "--no-host", "LLAMA_ARG_NO_HOST", "",
        ign(_OFFLOAD)),
    (_COMMON, "-ctk, --cache-type-k TYPE", "LLAMA_ARG_CACHE_TYPE_K", "f16",
        sup("cache_type_k")),
    (_COMMON, "-ctv, --cache-type-v TYPE", "LLAMA_ARG_CACHE_TYPE_V", "f16",
        sup("cache_type_v")),
    (_COMMON, "-dt, --defrag-thold N", "LLAMA_ARG_DEFRAG_THOLD", "",
        ign("KV defragmentation is a llama.cpp detail")),
    (_COMMON, "--rpc SERVERS", "LLAMA_ARG_RPC", "",
        ign("llama.cpp RPC backends are not used")),
    (_COMMON, "--mlock", "LLAMA_ARG_MLOCK", "",
        ign(_MEMORY)),
    (_COMMON, "--mmap, --no-mmap", "LLAMA_ARG_MMAP", "",
        ign(_MEMORY)),
    (_COMMON, "-dio, --direct-io, -ndio, --no-direct-io", "LLAMA_ARG_DIO", "",
        ign(_MEMORY)),
    (_COMMON, "-lm, --load-mode MODE", "LLAMA_ARG_LOAD_MODE", "auto",
        ign(_MEMORY)),
    (_COMMON, "--numa TYPE", "LLAMA_ARG_NUMA", "",
        ign(_THREADS)),
    (_COMMON, "-dev, --device <dev1,dev2,..>", "LLAMA_ARG_DEVICE", "",
        ign(_OFFLOAD)),
    (_COMMON, "--list-devices", "", "",
        ref("not available; MLX runs on its default device")),
    (_COMMON,
     "-ot, --override-tensor <tensor name pattern>=<buffer type>,...",
     "LLAMA_ARG_OVERRIDE_TENSOR",
     "",
        ign(_OFFLOAD)),
    (_COMMON, "-cmoe, --cpu-moe", "LLAMA_ARG_CPU_MOE", "",
        ign(_OFFLOAD)),
    (_COMMON, "-ncmoe, --n-cpu-moe N", "LLAMA_ARG_N_CPU_MOE", "",
        ign(_OFFLOAD)),
    (_COMMON, "-ngl, --gpu-layers, --n-gpu-layers N", "LLAMA_ARG_N_GPU_LAYERS", "auto",
        ign(_OFFLOAD)),
    (_COMMON, "-sm, --split-mode {none,layer,row,tensor}", "LLAMA_ARG_SPLIT_MODE", "",
        ign(_OFFLOAD)),
    (_COMMON, "-ts, --tensor-split N0,N1,N2,...", "LLAMA_ARG_TENSOR_SPLIT", "",
        ign(_OFFLOAD)),
    (_COMMON, "-mg, --main-gpu INDEX", "LLAMA_ARG_MAIN_GPU", "0",
        ign(_OFFLOAD)),
    (_COMMON, "-fit, --fit [on|off]", "LLAMA_ARG_FIT", "'on'",
        ign("llama.cpp memory fitting; MLX uses unified memory")),
    (_COMMON, "-fitt, --fit-target MiB0,MiB1,MiB2,...", "LLAMA_ARG_FIT_TARGET", "1024",
        ign("llama.cpp memory fitting; MLX uses unified memory")),
    (_COMMON, "-fitc, --fit-ctx N", "LLAMA_ARG_FIT_CTX", "4096",
        ign("llama.cpp memory fitting; MLX uses unified memory")),
    (_COMMON, "--check-tensors", "", "false",
        ign("tensor checks are a llama.cpp loader option")),
    (_COMMON, "--override-kv KEY=TYPE:VALUE,...", "", "",
        ref("overriding model metadata is not supported")),
    (_COMMON, "--op-offload, --no-op-offload", "", "true",
        ign(_OFFLOAD)),
    (_COMMON, "--lora FNAME", "", "",
        ref(_ADAPTERS)),
    (_COMMON, "--lora-scaled FNAME:SCALE,...", "", "",
        ref(_ADAPTERS)),
    (_COMMON, "--control-vector FNAME", "", "",
        ref(_ADAPTERS)),
    (_COMMON, "--control-vector-scaled FNAME:SCALE,...", "", "",
        ref(_ADAPTERS)),
    (_COMMON, "--control-vector-layer-range START END", "", "",
        ref(_ADAPTERS)),
    (_COMMON, "-m, --model FNAME", "LLAMA_ARG_MODEL", "",
        sup("model")),
    (_COMMON, "-mu, --model-url MODEL_URL", "LLAMA_ARG_MODEL_URL", "unused",
        ref(_DOWNLOAD)),
    (_COMMON, "-dr, --docker-repo [<repo>/]<model>[:quant]", "LLAMA_ARG_DOCKER_REPO", "unused",
        ref(_DOWNLOAD)),
    (_COMMON, "-hf, -hfr, --hf-repo <user>/<model>[:quant]", "LLAMA_ARG_HF_REPO", "unused",
        ref(_DOWNLOAD)),
    (_COMMON, "-hff, --hf-file FILE", "LLAMA_ARG_HF_FILE", "unused",
        ref(_DOWNLOAD)),
    (_COMMON, "-hft, --hf-token TOKEN", "HF_TOKEN", "value from HF_TOKEN environment variable",
        ign("mlxcel never downloads, so no token is needed")),
    (_COMMON, "--log-disable", "", "",
        sup("log_disable")),
    (_COMMON, "--log-file FNAME", "LLAMA_ARG_LOG_FILE", "",
        sup("log_file")),
    (_COMMON, "--log-colors [on|off|auto]", "LLAMA_ARG_LOG_COLORS", "'auto'",
        sup("log_colors")),
    (_COMMON, "-v, --verbose, --log-verbose", "", "",
        sup("verbose")),
    (_COMMON, "--offline", "LLAMA_ARG_OFFLINE", "",
        ign("mlxcel never goes online")),
    (_COMMON, "-lv, --verbosity, --log-verbosity N", "LLAMA_ARG_LOG_VERBOSITY", "3",
        sup("log_verbosity")),
    (_COMMON, "--log-prefix, --no-log-prefix", "LLAMA_ARG_LOG_PREFIX", "",
        sup("log_prefix")),
    (_COMMON, "--log-timestamps, --no-log-timestamps", "LLAMA_ARG_LOG_TIMESTAMPS", "",
        sup("log_timestamps")),
    (_COMMON,
     "--spec-draft-type-k, -ctkd, --cache-type-k-draft TYPE",
     "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K",
     "f16",
        ign(_KV_TYPE)),
    (_COMMON,
     "--spec-draft-type-v, -ctvd, --cache-type-v-draft TYPE",
     "LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V",
     "f16",
        ign(_KV_TYPE)),
    (_SAMPLING,
     "--samplers SAMPLERS",
     "",
     "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature",
        ref("the sampler order is fixed")),
    (_SAMPLING, "-s, --seed SEED", "", "-1, use random seed for -1",
        sup("seed")),
    (_SAMPLING, "--sampler-seq, --sampling-seq SEQUENCE", "", "edskypmxt",
        ref("the sampler order is fixed")),
    (_SAMPLING, "--ignore-eos", "", "",
        sup("ignore_eos")),
    (_SAMPLING, "--temp, --temperature N", "", "0.80",
        sup("temp")),
    (_SAMPLING, "--top-k N", "LLAMA_ARG_TOP_K", "40, 0 = disabled",
        sup("top_k")),
    (_SAMPLING, "--top-p N", "", "0.95, 1.0 = disabled",
        sup("top_p")),
    (_SAMPLING, "--min-p N", "", "0.05, 0.0 = disabled",
        sup("min_p")),
    (_SAMPLING, "--top-nsigma, --top-n-sigma N", "", "-1.00, -1.0 = disabled",
        sup("top_n_sigma")),
    (_SAMPLING, "--xtc-probability N", "", "0.00, 0.0 = disabled",
        sup("xtc_probability")),
    (_SAMPLING, "--xtc-threshold N", "", "0.10, 1.0 = disabled",
        sup("xtc_threshold")),
    (_SAMPLING, "--typical, --typical-p N", "", "1.00, 1.0 = disabled",
        sup("typical_p")),
    (_SAMPLING, "--repeat-last-n N", "", "64, 0 = disabled",
        sup("repeat_last_n")),
    (_SAMPLING, "--repeat-penalty N", "", "1.00, 1.0 = disabled",
        sup("repeat_penalty")),
    (_SAMPLING, "--presence-penalty N", "", "0.00, 0.0 = disabled",
        sup("presence_penalty")),
    (_SAMPLING, "--frequency-penalty N", "", "0.00, 0.0 = disabled",
        sup("frequency_penalty")),
    (_SAMPLING, "--dry-multiplier N", "", "0.00, 0.0 = disabled",
        sup("dry_multiplier")),
    (_SAMPLING, "--dry-base N", "", "1.75",
        sup("dry_base")),
    (_SAMPLING, "--dry-allowed-length N", "", "2",
        sup("dry_allowed_length")),
    (_SAMPLING, "--dry-penalty-last-n N", "", "64, 0 = disable",
        sup("dry_penalty_last_n")),
    (_SAMPLING, "--dry-sequence-breaker STRING", "", "",
        sup("dry_sequence_breaker")),
    (_SAMPLING, "--adaptive-target N", "", "-1.00",
        sup("adaptive_target")),
    (_SAMPLING, "--adaptive-decay N", "", "0.90",
        sup("adaptive_decay")),
    (_SAMPLING, "--dynatemp-range N", "", "0.00, 0.0 = disabled",
        sup("dynatemp_range")),
    (_SAMPLING, "--dynatemp-exp N", "", "1.00",
        sup("dynatemp_exponent")),
    (_SAMPLING, "--mirostat N", "", "0, 0 = disabled, 1 = Mirostat, 2 = Mirostat 2.0",
        sup("mirostat")),
    (_SAMPLING, "--mirostat-lr N", "", "0.10",
        sup("mirostat_eta")),
    (_SAMPLING, "--mirostat-ent N", "", "5.00",
        sup("mirostat_tau")),
    (_SAMPLING, "-l, --logit-bias TOKEN_ID(+/-)BIAS", "", "",
        ref("server-wide logit biases are not supported; send logit_bias per request")),
    (_SAMPLING, "--grammar GRAMMAR", "", "",
        ref("a server-wide grammar is not supported; send grammar per request")),
    (_SAMPLING, "--grammar-file FNAME", "", "",
        ref("a server-wide grammar is not supported; send grammar per request")),
    (_SAMPLING, "-j, --json-schema SCHEMA", "", "",
        ref("a server-wide JSON schema is not supported; send json_schema per request")),
    (_SAMPLING, "-jf, --json-schema-file FILE", "", "",
        ref("a server-wide JSON schema is not supported; send json_schema per request")),
    (_SAMPLING, "-bs, --backend-sampling", "LLAMA_ARG_BACKEND_SAMPLING", "disabled",
        ign("where sampling runs is a llama.cpp backend detail")),
    (_SERVER, "-lcs, --lookup-cache-static FNAME", "", "",
        ign("lookup-decoding caches are not used")),
    (_SERVER, "-lcd, --lookup-cache-dynamic FNAME", "", "",
        ign("lookup-decoding caches are not used")),
    (_SERVER,
     "-ctxcp, --ctx-checkpoints, --swa-checkpoints N",
     "LLAMA_ARG_CTX_CHECKPOINTS",
     "32)[(more info)](https://github.com/ggml-org/llama.cpp/pull/15293",
        ign(_CACHE)),
    (_SERVER,
     "-cms, --checkpoint-min-step N",
     "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT",
     "8192, 0 = no minimum",
        ign(_CACHE)),
    (_SERVER,
     "-cram, --cache-ram N",
     "LLAMA_ARG_CACHE_RAM",
     "8192, -1 - no limit, 0 - disable)[(more "
     "info)](https://github.com/ggml-org/llama.cpp/pull/16391",
        sup("cache_ram")),
    (_SERVER,
     "-kvu, --kv-unified, -no-kvu, --no-kv-unified",
     "LLAMA_ARG_KV_UNIFIED",
     "enabled if number of slots is auto",
        sup("kv_unified")),
    (_SERVER,
     "--cache-idle-slots, --no-cache-idle-slots",
     "LLAMA_ARG_CACHE_IDLE_SLOTS",
     "enabled, requires cache-ram",
        ign(_CACHE)),
    (_SERVER, "--context-shift, --no-context-shift", "LLAMA_ARG_CONTEXT_SHIFT", "disabled",
        ref("context shift is not implemented: generation stops at the context limit",
            allow=("--no-context-shift",))),
    (_SERVER, "-r, --reverse-prompt PROMPT", "", "",
        ref("reverse prompts are not supported; send stop strings per request")),
    (_SERVER, "-sp, --special", "", "false",
        sup("special")),
    (_SERVER, "--warmup, --no-warmup", "", "enabled",
        sup("warmup")),
    (_SERVER, "--spm-infill", "", "disabled",
        ref("the SPM infill order is not supported")),
    (_SERVER, "--pooling {none,mean,cls,last,rank}", "LLAMA_ARG_POOLING", "",
        sup("pooling")),
    (_SERVER, "-np, --parallel N", "LLAMA_ARG_N_PARALLEL", "-1, -1 = auto",
        sup("parallel")),
    (_SERVER,
     "-cb, --cont-batching, -nocb, --no-cont-batching",
     "LLAMA_ARG_CONT_BATCHING",
     "enabled",
        ign("mlxcel always batches continuously")),
    (_SERVER, "-mm, --mmproj FILE", "LLAMA_ARG_MMPROJ", "",
        ref(_MULTIMODAL)),
    (_SERVER, "-mmu, --mmproj-url URL", "LLAMA_ARG_MMPROJ_URL", "",
        ref(_MULTIMODAL)),
    (_SERVER, "--mmproj-auto, --no-mmproj, --no-mmproj-auto", "LLAMA_ARG_MMPROJ_AUTO", "enabled",
        ign("projectors are never downloaded")),
    (_SERVER, "--mmproj-offload, --no-mmproj-offload", "LLAMA_ARG_MMPROJ_OFFLOAD", "enabled",
        ign(_OFFLOAD)),
    (_SERVER, "--image-min-tokens N", "LLAMA_ARG_IMAGE_MIN_TOKENS", "read from model",
        ign("tunes multimodal projectors, which are not supported")),
    (_SERVER, "--image-max-tokens N", "LLAMA_ARG_IMAGE_MAX_TOKENS", "read from model",
        ign("tunes multimodal projectors, which are not supported")),
    (_SERVER, "--mtmd-batch-max-tokens N", "LLAMA_ARG_MTMD_BATCH_MAX_TOKENS", "1024",
        ign("tunes multimodal projectors, which are not supported")),
    (_SERVER, "-a, --alias STRING", "LLAMA_ARG_ALIAS", "",
        sup("alias")),
    (_SERVER, "--tags STRING", "LLAMA_ARG_TAGS", "",
        sup("tags")),
    (_SERVER,
     "--embd-normalize N",
     "",
     "2) (-1=none, 0=max absolute int16, 1=taxicab, 2=euclidean, >2=p-norm",
        sup("embd_normalize")),
    (_SERVER, "--host HOST", "LLAMA_ARG_HOST", "127.0.0.1",
        sup("host")),
    (_SERVER, "--port PORT", "LLAMA_ARG_PORT", "8080",
        sup("port")),
    (_SERVER, "--reuse-port", "LLAMA_ARG_REUSE_PORT", "disabled",
        ign("SO_REUSEPORT is not used")),
    (_SERVER, "--path PATH", "LLAMA_ARG_STATIC_PATH", "",
        ign(_UI)),
    (_SERVER, "--cors-origins ORIGINS", "LLAMA_ARG_CORS_ORIGINS", "*",
        sup("cors_origins")),
    (_SERVER, "--cors-methods METHODS", "LLAMA_ARG_CORS_METHODS", "GET, POST, DELETE, OPTIONS",
        sup("cors_methods")),
    (_SERVER, "--cors-headers HEADERS", "LLAMA_ARG_CORS_HEADERS", "*",
        sup("cors_headers")),
    (_SERVER, "--cors-credentials, --no-cors-credentials", "LLAMA_ARG_CORS_CREDENTIALS", "enabled",
        sup("cors_credentials")),
    (_SERVER, "--api-prefix PREFIX", "LLAMA_ARG_API_PREFIX", "",
        sup("api_prefix")),
    (_SERVER, "--ui-config, --webui-config JSON", "LLAMA_ARG_UI_CONFIG", "",
        ign(_UI)),
    (_SERVER, "--ui-config-file, --webui-config-file PATH", "LLAMA_ARG_UI_CONFIG_FILE", "",
        ign(_UI)),
    (_SERVER,
     "--ui-mcp-proxy, --webui-mcp-proxy, --no-ui-mcp-proxy, --no-webui-mcp-proxy",
     "LLAMA_ARG_UI_MCP_PROXY",
     "disabled",
        ign(_UI)),
    (_SERVER, "--tools TOOL1,TOOL2,...", "LLAMA_ARG_TOOLS", "no tools",
        ref(_TOOLS)),
    (_SERVER, "--tools-runtime OPTION", "LLAMA_ARG_TOOLS_RUNTIME", "none, use host environment",
        ref(_TOOLS)),
    (_SERVER, "--mcp-servers-config PATH", "LLAMA_ARG_MCP_SERVERS_CONFIG", "none",
        ref(_TOOLS)),
    (_SERVER, "--mcp-servers-json JSON", "LLAMA_ARG_MCP_SERVERS_JSON", "none",
        ref(_TOOLS)),
    (_SERVER, "-ag, --agent, -no-ag, --no-agent", "LLAMA_ARG_AGENT", "disabled",
        ref(_TOOLS, allow=("-no-ag", "--no-agent"))),
    (_SERVER, "--ui, --webui, --no-ui, --no-webui", "LLAMA_ARG_UI", "enabled",
        ign(_UI)),
    (_SERVER, "--embedding, --embeddings", "LLAMA_ARG_EMBEDDINGS", "disabled",
        sup("embedding")),
    (_SERVER, "--rerank, --reranking", "LLAMA_ARG_RERANKING", "disabled",
        sup("reranking")),
    (_SERVER, "--api-key KEY", "LLAMA_API_KEY", "none",
        sup("api_key")),
    (_SERVER, "--api-key-file FNAME", "LLAMA_ARG_API_KEY_FILE", "none",
        sup("api_key_file")),
    (_SERVER, "--ssl-key-file FNAME", "LLAMA_ARG_SSL_KEY_FILE", "",
        sup("ssl_key_file")),
    (_SERVER, "--ssl-cert-file FNAME", "LLAMA_ARG_SSL_CERT_FILE", "",
        sup("ssl_cert_file")),
    (_SERVER, "--chat-template-kwargs STRING", "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "",
        sup("chat_template_kwargs")),
    (_SERVER, "-to, --timeout N", "LLAMA_ARG_TIMEOUT", "3600",
        sup("timeout")),
    (_SERVER, "--sse-ping-interval N", "LLAMA_ARG_SSE_PING_INTERVAL", "30",
        sup("sse_ping_interval")),
    (_SERVER, "--threads-http N", "LLAMA_ARG_THREADS_HTTP", "-1",
        ign("the HTTP server runs on asyncio")),
    (_SERVER, "--cache-prompt, --no-cache-prompt", "LLAMA_ARG_CACHE_PROMPT", "enabled",
        sup("cache_prompt")),
    (_SERVER, "--cache-reuse N", "LLAMA_ARG_CACHE_REUSE", "0",
        ign("KV shifting is a llama.cpp detail; mlxcel reuses cached prefixes")),
    (_SERVER, "--metrics", "LLAMA_ARG_ENDPOINT_METRICS", "disabled",
        sup("metrics")),
    (_SERVER, "--props", "LLAMA_ARG_ENDPOINT_PROPS", "disabled",
        sup("props")),
    (_SERVER, "--slots, --no-slots", "LLAMA_ARG_ENDPOINT_SLOTS", "enabled",
        sup("slots")),
    (_SERVER, "--slot-save-path PATH", "", "disabled",
        sup("slot_save_path")),
    (_SERVER, "--media-path PATH", "", "disabled",
        sup("media_path")),
    (_SERVER, "--models-dir PATH", "LLAMA_ARG_MODELS_DIR", "disabled",
        sup("models_dir")),
    (_SERVER, "--models-preset PATH", "LLAMA_ARG_MODELS_PRESET", "disabled",
        sup("models_preset")),
    (_SERVER, "--models-max N", "LLAMA_ARG_MODELS_MAX", "4, 0 = unlimited",
        sup("models_max")),
    (_SERVER, "--models-autoload, --no-models-autoload", "LLAMA_ARG_MODELS_AUTOLOAD", "enabled",
        sup("models_autoload")),
    (_SERVER, "--jinja, --no-jinja", "LLAMA_ARG_JINJA", "enabled",
        sup("jinja")),
    (_SERVER, "--reasoning-format FORMAT", "LLAMA_ARG_THINK", "auto",
        sup("reasoning_format")),
    (_SERVER,
     "-rea, --reasoning [on|off|auto]",
     "LLAMA_ARG_REASONING",
     "'auto' (detect from template",
        sup("reasoning", "on/off set the templates' default enable_thinking")),
    (_SERVER, "--reasoning-effort LEVEL", "LLAMA_ARG_REASONING_EFFORT", "default",
        ref("a server-wide reasoning effort is not supported; send it per request",
            noop=("default",))),
    (_SERVER, "--reasoning-budget N", "LLAMA_ARG_THINK_BUDGET", "-1",
        sup("reasoning_budget")),
    (_SERVER, "--reasoning-budget-message MESSAGE", "LLAMA_ARG_THINK_BUDGET_MESSAGE", "none",
        ref("a budget-exceeded message is not supported")),
    (_SERVER,
     "--reasoning-preserve, --no-reasoning-preserve",
     "LLAMA_ARG_REASONING_PRESERVE",
     "template default",
        ref("keeping past reasoning is left to the chat template")),
    (_SERVER,
     "--chat-template JINJA_TEMPLATE",
     "LLAMA_ARG_CHAT_TEMPLATE",
     "template taken from model's metadata",
        sup("chat_template")),
    (_SERVER,
     "--chat-template-file JINJA_TEMPLATE_FILE",
     "LLAMA_ARG_CHAT_TEMPLATE_FILE",
     "template taken from model's metadata",
        sup("chat_template_file")),
    (_SERVER,
     "--skip-chat-parsing, --no-skip-chat-parsing",
     "LLAMA_ARG_SKIP_CHAT_PARSING",
     "disabled",
        ref("chat output is always parsed (reasoning, tool calls)",
            allow=("--no-skip-chat-parsing",))),
    (_SERVER,
     "--prefill-assistant, --no-prefill-assistant",
     "LLAMA_ARG_PREFILL_ASSISTANT",
     "prefill enabled",
        ref("a trailing assistant message is always continued", allow=("--prefill-assistant",))),
    (_SERVER, "-sps, --slot-prompt-similarity SIMILARITY", "", "0.10, 0.0 = disabled",
        ign("mlxcel picks slots by cached prefix")),
    (_SERVER, "--lora-init-without-apply", "", "disabled",
        ref(_ADAPTERS)),
    (_SERVER, "--sleep-idle-seconds SECONDS", "", "-1; -1 = disabled",
        sup("sleep_idle_seconds")),
    (_SERVER, "--log-prompts-dir PATH", "", "disabled",
        ign("prompt logging to files is not implemented")),
    (_SERVER,
     "--spec-draft-hf, -hfd, -hfrd, --hf-repo-draft <user>/<model>[:quant]",
     "LLAMA_ARG_SPEC_DRAFT_HF_REPO",
     "unused",
        ref(_DOWNLOAD)),
    (_SERVER, "--spec-draft-threads, -td, --threads-draft N", "", "same as --threads",
        ign(_THREADS)),
    (_SERVER,
     "--spec-draft-threads-batch, -tbd, --threads-batch-draft N",
     "",
     "same as --threads-draft",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-cpu-mask, -Cd, --cpu-mask-draft M", "", "same as --cpu-mask",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-cpu-range, -Crd, --cpu-range-draft lo-hi", "", "",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-cpu-strict, --cpu-strict-draft <0|1>", "", "same as --cpu-strict",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-prio, --prio-draft N", "", "0",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-poll, --poll-draft <0|1>", "", "same as --poll",
        ign(_THREADS)),
    (_SERVER,
     "--spec-draft-cpu-mask-batch, -Cbd, --cpu-mask-batch-draft M",
     "",
     "same as --cpu-mask",
        ign(_THREADS)),
    (_SERVER,
     "--spec-draft-cpu-strict-batch, --cpu-strict-batch-draft <0|1>",
     "",
     "--cpu-strict-draft",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-prio-batch, --prio-batch-draft N", "", "0",
        ign(_THREADS)),
    (_SERVER, "--spec-draft-poll-batch, --poll-batch-draft <0|1>", "", "--poll-draft",
        ign(_THREADS)),
    (_SERVER,
     "--spec-draft-override-tensor, -otd, --override-tensor-draft <tensor name "
     "pattern>=<buffer type>,...",
     "",
     "",
        ign(_OFFLOAD)),
    (_SERVER, "--spec-draft-cpu-moe, -cmoed, --cpu-moe-draft", "LLAMA_ARG_SPEC_DRAFT_CPU_MOE", "",
        ign(_OFFLOAD)),
    (_SERVER,
     "--spec-draft-n-cpu-moe, --spec-draft-ncmoe, -ncmoed, --n-cpu-moe-draft N",
     "LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
     "",
        ign(_OFFLOAD)),
    (_SERVER, "--spec-draft-n-max N", "LLAMA_ARG_SPEC_DRAFT_N_MAX", "3",
        sup("spec_draft_n_max")),
    (_SERVER, "--spec-draft-n-min N", "LLAMA_ARG_SPEC_DRAFT_N_MIN", "0",
        sup("spec_draft_n_min")),
    (_SERVER, "--spec-draft-p-split, --draft-p-split P", "LLAMA_ARG_SPEC_DRAFT_P_SPLIT", "0.10",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-draft-p-min, --draft-p-min P", "LLAMA_ARG_SPEC_DRAFT_P_MIN", "0.00",
        ign(_SPEC_TUNE)),
    (_SERVER,
     "--spec-draft-backend-sampling, --no-spec-draft-backend-sampling",
     "LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING",
     "enabled",
        ign("where sampling runs is a llama.cpp backend detail")),
    (_SERVER, "--spec-draft-device, -devd, --device-draft <dev1,dev2,..>", "", "",
        ign(_OFFLOAD)),
    (_SERVER,
     "--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft N",
     "LLAMA_ARG_N_GPU_LAYERS_DRAFT",
     "auto",
        ign(_OFFLOAD)),
    (_SERVER,
     "--spec-draft-model, -md, --model-draft FNAME",
     "LLAMA_ARG_SPEC_DRAFT_MODEL",
     "unused",
        sup("spec_draft_model")),
    (_SERVER,
     "--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,"
     "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache",
     "LLAMA_ARG_SPEC_TYPE",
     "none",
        sup("spec_type", "none, ngram-simple (prompt lookup) and draft-simple (draft model)")),
    (_SERVER, "--spec-ngram-mod-n-min N", "", "48",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-mod-n-max N", "", "64",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-mod-n-match N", "", "24",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-simple-size-n N", "", "12",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-simple-size-m N", "", "48",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-simple-min-hits N", "", "1",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k-size-n N", "", "12",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k-size-m N", "", "48",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k-min-hits N", "", "1",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k4v-size-n N", "", "12",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k4v-size-m N", "", "48",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-map-k4v-min-hits N", "", "1",
        ign(_SPEC_TUNE)),
    (_SERVER, "--draft, --draft-n, --draft-max N", "LLAMA_ARG_DRAFT_MAX", "",
        ign(_SPEC_TUNE)),
    (_SERVER, "--draft-min, --draft-n-min N", "LLAMA_ARG_DRAFT_MIN", "",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-size-n N", "", "",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-size-m N", "", "",
        ign(_SPEC_TUNE)),
    (_SERVER, "--spec-ngram-min-hits N", "", "",
        ign(_SPEC_TUNE)),
    (_SERVER, "--embd-gemma-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-1.5b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-3b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-7b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-7b-spec", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-14b-spec", "", "",
        ref(_PRESET)),
    (_SERVER, "--fim-qwen-30b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--gpt-oss-20b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--gpt-oss-120b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--vision-gemma-4b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--vision-gemma-12b-default", "", "",
        ref(_PRESET)),
    (_SERVER, "--spec-default", "", "",
        ref(_SPEC)),
    # mlxcel's own options
    (_MLXCEL, "-P, --profile NAME|PATH", "MLXCEL_PROFILE", "",
        act("profile", "Settings profile: a name or a TOML file")),
    (_MLXCEL, "--model-store DIR", "", "",
        sup("model_store")),
    (_MLXCEL, "--cpu-dtype {auto,float32,keep}", "", "",
        sup("cpu_dtype")),
    (_MLXCEL, "--distributed", "", "",
        sup("distributed")),
    (_MLXCEL, "--pipeline", "", "",
        sup("pipeline")),
    (_MLXCEL, "--distributed-timeout SECONDS", "", "",
        sup("distributed_timeout")),
    (_MLXCEL, "--prompt-cache-dir DIR", "", "",
        sup("prompt_cache_dir")),
    (_MLXCEL, "--prompt-cache-disk-mib N", "", "",
        sup("prompt_cache_disk_mib")),
    (_MLXCEL, "--no-chat-template", "", "",
        sup("no_chat_template")),
    (_MLXCEL, "--grammar-backend {llguidance,xgrammar}", "", "",
        sup("grammar_backend")),
    (_MLXCEL, "--loop-detection SPEC", "", "",
        sup("loop_detection")),
    (_MLXCEL, "--metrics-port PORT", "", "",
        sup("metrics_port")),
    (_MLXCEL, "--responses-store-max-entries N", "LLAMA_ARG_RESPONSES_STORE_MAX_ENTRIES", "1024",
        sup("responses_store_max_entries")),
    (_MLXCEL, "--responses-store-ttl-secs N", "LLAMA_ARG_RESPONSES_STORE_TTL_SECS", "3600",
        sup("responses_store_ttl_secs")),
    (_MLXCEL,
     "--conversation-store-max-entries N",
     "LLAMA_ARG_CONVERSATION_STORE_MAX_ENTRIES",
     "256",
        sup("conversation_store_max_entries")),
    (_MLXCEL, "--conversation-store-ttl-secs N", "LLAMA_ARG_CONVERSATION_STORE_TTL_SECS", "3600",
        sup("conversation_store_ttl_secs")),
    (_MLXCEL, "--max-queue-depth N", "", "",
        sup("max_queue_depth")),
    (_MLXCEL, "--max-connections N", "", "",
        sup("max_connections")),
    (_MLXCEL, "--max-body-size BYTES", "", "",
        sup("max_body_size")),
    (_MLXCEL, "--cache-ttl-secs N", "", "",
        sup("cache_ttl_secs")),
    (_MLXCEL, "--embedding-model MODEL", "", "",
        sup("embedding_model")),
    (_MLXCEL, "--reranker-model MODEL", "", "",
        sup("reranker_model")),
    (_MLXCEL, "--embedding-batch-size N", "", "",
        sup("embedding_batch_size")),
    (_MLXCEL, "--embedding-queue-depth N", "", "",
        sup("embedding_queue_depth")),
    (_MLXCEL, "--embedding-timeout SECONDS", "", "",
        sup("embedding_timeout")),
    (_MLXCEL, "--embedding-max-inputs N", "", "",
        sup("embedding_max_inputs")),
    (_MLXCEL, "--audio-model MODEL", "", "",
        sup("audio_model")),
    (_MLXCEL, "--tts-model DIR", "", "",
        sup("tts_model")),
    (_MLXCEL, "--audio-queue-depth N", "", "",
        sup("audio_queue_depth")),
    (_MLXCEL, "--audio-timeout SECONDS", "", "",
        sup("audio_timeout")),
    (_MLXCEL, "--image-model PATH", "", "",
        sup("image_model")),
    (_MLXCEL, "--image-queue-depth N", "", "",
        sup("image_queue_depth")),
    (_MLXCEL, "--image-timeout SECONDS", "", "",
        sup("image_timeout")),
    (_MLXCEL, "--realtime-max-sessions N", "", "",
        sup("realtime_max_sessions")),
    (_MLXCEL, "--realtime-idle-timeout SECONDS", "", "",
        sup("realtime_idle_timeout")),
    (_MLXCEL, "--realtime-max-audio-seconds SECONDS", "", "",
        sup("realtime_max_audio_seconds")),
    (_MLXCEL, "--video-max-frames N", "", "",
        sup("video_max_frames")),
)
# fmt: on

_SPELLING_RE = re.compile(r"-{1,2}[A-Za-z0-9][A-Za-z0-9.\-]*")
_OPTIONAL_RE = re.compile(r"^\[([^\[\]]+)\]$")
_GROUP_RE = re.compile(r"<[^>]*>|\{[^}]*\}|\[[^\]]*\]|\([^)]*\)")
_SHORT_NEGATIVES = frozenset({"-nkvo", "-nr", "-ndio", "-nocb"})


@dataclass(frozen=True)
class Flag:
    """One option row: its spellings, value shape and status."""

    section: str
    text: str
    tsv_env: str
    tsv_default: str
    spec: Spec
    spellings: tuple[str, ...]
    metavar: str | None
    nargs: int
    optional: bool
    choices: tuple[str, ...]
    negatives: frozenset[str]

    @property
    def status(self) -> Status:
        return self.spec.status

    @property
    def field(self) -> str | None:
        return self.spec.field

    @property
    def env(self) -> str:
        """The environment variable: the field's for supported rows, else llama-server's."""
        return field_meta(self.spec.field).env if self.spec.field else self.tsv_env

    @property
    def help(self) -> str:
        """The help line: the field's help for supported rows, else the note."""
        if self.spec.field:
            return field_meta(self.spec.field).help
        return self.spec.note

    @property
    def name(self) -> str:
        """The main spelling: the first positive long one (`--ctx-size`)."""
        longs = [s for s in self.spellings if s.startswith("--") and s not in self.negatives]
        return longs[0] if longs else self.spellings[0]

    def default_text(self) -> str:
        """The default as shown in help and docs (mlxcel's own for supported rows)."""
        if not self.spec.field:
            return self.tsv_default
        return _show_value(field_meta(self.spec.field).default)


def _show_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def _split_text(text: str) -> tuple[tuple[str, ...], str | None]:
    """'-c, --ctx-size N' -> (('-c', '--ctx-size'), 'N')."""
    spellings: list[str] = []
    rest = text
    while True:
        match = _SPELLING_RE.match(rest)
        if not match:
            break
        spellings.append(match.group())
        rest = rest[match.end() :]
        if rest.startswith(", -"):
            rest = rest[2:]
            continue
        break
    if not spellings or (rest and not rest.startswith(" ")):
        raise ValueError(f"bad option text {text!r}")
    return tuple(spellings), rest.strip() or None


def _is_negative(spelling: str) -> bool:
    return spelling.startswith(("--no-", "-no-")) or spelling in _SHORT_NEGATIVES


def _build(section: str, text: str, env: str, default: str, spec: Spec) -> Flag:
    spellings, metavar = _split_text(text)
    optional = bool(metavar and _OPTIONAL_RE.match(metavar))
    choices: tuple[str, ...] = ()
    if optional and metavar:
        choices = tuple(c.strip().lower() for c in metavar[1:-1].split("|"))
        nargs = 1
    elif metavar:
        nargs = len(_GROUP_RE.sub("X", metavar).split())
    else:
        nargs = 0
    negatives = frozenset(s for s in spellings if _is_negative(s))
    if negatives == frozenset(spellings):  # e.g. --no-host: a plain switch
        negatives = frozenset()
    if spec.field:
        field_meta(spec.field)  # fail at import on a typo
    return Flag(
        section, text, env, default, spec, spellings, metavar, nargs, optional, choices, negatives
    )


FLAGS: tuple[Flag, ...] = tuple(_build(*row) for row in _ROWS)
"""Every option row: llama-server's (in its order), then mlxcel's own."""

_BY_SPELLING: dict[str, Flag] = {}
for _flag in FLAGS:
    for _spelling in _flag.spellings:
        if _spelling in _BY_SPELLING:
            raise RuntimeError(f"option {_spelling} is listed twice")
        _BY_SPELLING[_spelling] = _flag
_BY_FIELD: dict[str, Flag] = {}
for _flag in FLAGS:
    if _flag.field:
        _BY_FIELD.setdefault(_flag.field, _flag)


def lookup(spelling: str) -> Flag | None:
    """The row of an option spelling such as `-c` or `--ctx-size`."""
    return _BY_SPELLING.get(spelling)


def flag_for_field(name: str) -> Flag | None:
    """The option row that sets settings field `name`."""
    return _BY_FIELD.get(name)


def cli_label(name: str) -> str:
    """How to name field `name` in an error: its long option, e.g. `--ctx-size`."""
    flag = _BY_FIELD.get(name)
    return flag.name if flag else f"--{name.replace('_', '-')}"


@dataclass
class ServeArgs:
    """The outcome of parsing `mlxcel serve` arguments."""

    cli: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    profile: str | None = None
    action: str | None = None


def _is_noop(value: str, noop: Iterable[str]) -> bool:
    text = value.strip().lower()
    for candidate in noop:
        if text == candidate:
            return True
        try:
            if float(text) == float(candidate):
                return True
        except ValueError:
            continue
    return False


def _field_value(flag: Flag, spelling: str, values: list[str], cli: dict[str, Any]) -> Any:
    name = flag.field
    assert name is not None
    if flag.nargs == 0 or (flag.optional and not values):
        if flag.optional:
            raw = flag.choices[0]
        else:
            return spelling not in flag.negatives
    else:
        raw = values[0]
    if flag.optional:
        raw = raw.lower()
    if is_text_field(name):
        return raw
    value = parse_text(name, raw, label=spelling)
    if isinstance(value, list):
        if name == "dry_sequence_breaker" and raw.strip().lower() == "none":
            return []
        return [*cli.get(name, []), *value]
    return value


def _apply(flag: Flag, spelling: str, values: list[str], out: ServeArgs) -> None:
    shown = " ".join([spelling, *values])
    spec = flag.spec
    if spec.status is Status.SUPPORTED:
        if spec.action == "profile":
            out.profile = values[0]
        elif spec.action:
            out.action = out.action or spec.action
        elif spec.field:
            value = _field_value(flag, spelling, values, out.cli)
            out.cli.update(validate_values({spec.field: value}, lambda _key: spelling))
        return
    if spec.status is Status.REFUSED and not (
        spelling in spec.allow or (values and _is_noop(values[0], spec.noop))
    ):
        raise SettingsError(f"{shown}: not supported by mlxcel: {spec.note}")
    out.warnings.append(f"ignoring {shown}: {spec.note}")


def _is_choice(flag: Flag, word: str) -> bool:
    """Whether `word` is the value of the optional-value option `flag`: one of its choices,
    or, for an on/off/auto option, any word (llama.cpp's 1/0, true/false, -1 ...)."""
    text = word.strip().lower()
    if text in flag.choices:
        return True
    # llama.cpp's on/off/auto options always take a value: a word is theirs (and is
    # checked), only the next option is not
    on_off_auto = {"on", "off", "auto"} <= set(flag.choices)
    return on_off_auto and (not text.startswith("-") or text == "-1")


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """Parse llama-server style arguments (`-c 4096`, `--port=8080`, `--no-slots`, ...).

    Supported options land in `.cli` (field -> typed value, for `resolve_settings`),
    ignored ones add one warning line each, refused and unknown ones raise SettingsError.
    """
    out = ServeArgs()
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("-") or token in ("-", "--"):
            raise SettingsError(f"unexpected argument {token!r}")
        spelling, inline = token, None
        if "=" in token:
            spelling, inline = token.split("=", 1)
        if spelling.startswith("--"):
            spelling = spelling.replace("_", "-")  # llama-server's --flag_with_underscores
        flag = _BY_SPELLING.get(spelling)
        if flag is None:
            close = difflib.get_close_matches(spelling, list(_BY_SPELLING), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SettingsError(f"unknown option {spelling}{hint}")
        values: list[str] = [] if inline is None else [inline]
        if flag.optional:
            if inline is None and i < len(argv) and _is_choice(flag, argv[i]):
                values.append(argv[i])
                i += 1
        elif flag.nargs == 0:
            if inline is not None:
                raise SettingsError(f"{spelling} takes no value")
        else:
            need = flag.nargs - len(values)
            if i + need > len(argv):
                raise SettingsError(f"{spelling} needs a value: {flag.metavar}")
            values.extend(argv[i : i + need])
            i += need
        _apply(flag, spelling, values, out)
    return out


def env_warnings(env: Mapping[str, str]) -> list[str]:
    """One line per set environment variable of a refused option (they are not applied)."""
    lines: list[str] = []
    for flag in FLAGS:
        raw = env.get(flag.tsv_env) if flag.tsv_env and flag.status is Status.REFUSED else None
        if raw is None or not raw.strip() or _is_noop(raw, flag.spec.noop):
            continue
        on = parse_bool(raw)
        if on is not None and flag.spec.allow:
            allowed_negative = all(_is_negative(s) for s in flag.spec.allow)
            if on is not allowed_negative:
                continue
        lines.append(f"ignoring {flag.tsv_env}: not supported by mlxcel: {flag.spec.note}")
    return lines


def _sections() -> list[str]:
    return list(dict.fromkeys(flag.section for flag in FLAGS))


def serve_help(width: int = 100) -> str:
    """Help for `mlxcel serve`: supported options by section, then ignored and refused ones."""
    lines = [
        "usage: mlxcel serve [options]",
        "",
        "A drop-in llama-server: the same options and LLAMA_ARG_* variables. Precedence:",
        "built-in defaults < profile (-P) < environment < options.",
    ]
    column = 34
    for section in _sections():
        rows = [f for f in FLAGS if f.section == section and f.status is Status.SUPPORTED]
        if not rows:
            continue
        lines += ["", f"{section}:"]
        for flag in rows:
            extras = []
            if flag.default_text():
                extras.append(f"default: {flag.default_text()}")
            if flag.env:
                extras.append(f"env: {flag.env}")
            text = flag.help + (f" ({'; '.join(extras)})" if extras else "")
            head = f"  {flag.text}"
            body = textwrap.wrap(text, width - column - 1) or [""]
            if len(head) >= column:
                lines.append(head)
                lines += [" " * column + part for part in body]
            else:
                lines.append(head.ljust(column) + body[0])
                lines += [" " * column + part for part in body[1:]]
    for status, title in (
        (Status.IGNORED, "Accepted and ignored (one warning line each):"),
        (Status.REFUSED, "Refused (an error):"),
    ):
        lines += ["", title]
        by_note: dict[str, list[str]] = {}
        for flag in FLAGS:
            if flag.status is status:
                by_note.setdefault(flag.spec.note, []).append(flag.name)
        for note, names in by_note.items():
            lines += textwrap.wrap(
                f"{', '.join(names)}: {note}",
                width,
                initial_indent="  ",
                subsequent_indent="      ",
                break_on_hyphens=False,
                break_long_words=False,
            )
    return "\n".join(lines) + "\n"


def _cell(text: str, code: bool = False) -> str:
    text = text.replace("\n", " ").replace("|", "\\|")
    return f"`{text}`" if code and text else text


def render_flags_markdown() -> str:
    """A markdown page with a table row per option: spellings, env, default, status, note."""
    counts = {s: sum(1 for f in FLAGS if f.status is s) for s in Status}
    out = [
        "# llama-server options in `mlxcel serve`",
        "",
        "Generated from `mlxcel/config/llama_flags.py`; do not edit by hand.",
        "",
        "- **supported**: sets the named setting (also settable by its env var and in a profile);",
        "- **ignored**: accepted with a one-line warning (no meaning under MLX);",
        "- **refused**: an error, since ignoring it would silently change results.",
        "",
        f"{len(FLAGS)} options: {counts[Status.SUPPORTED]} supported, "
        f"{counts[Status.IGNORED]} ignored, {counts[Status.REFUSED]} refused.",
    ]
    for section in _sections():
        out += [
            "",
            f"## {section}",
            "",
            "| Option | Env var | Default | Status | Note |",
            "|---|---|---|---|---|",
        ]
        for flag in (f for f in FLAGS if f.section == section):
            note = flag.spec.note
            if flag.field:
                note = f"`{flag.field}`: {flag.help}" + (f" ({note})" if note else "")
            elif flag.spec.noop or flag.spec.allow:
                accepted = ", ".join([*flag.spec.allow, *(f"value {v}" for v in flag.spec.noop)])
                note = f"{note} (accepted as a no-op: {accepted})"
            cells = [
                _cell(flag.text, code=True),
                _cell(flag.env, code=True),
                _cell(flag.default_text(), code=True),
                flag.status.value,
                _cell(note),
            ]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
