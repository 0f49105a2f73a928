"""Observability routes: /props, /slots, /metrics and the prompt-cache endpoints."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse

from mlxcel import __version__
from mlxcel.engine.blas import blas_in_use
from mlxcel.engine.cpu_kernels.build import kernel_status
from mlxcel.engine.defaults import sampling_from_settings
from mlxcel.server.errors import (
    APIError,
    bad_request,
    install_error_handlers,
    model_loading,
    server_busy,
)
from mlxcel.server.health import supports_tools
from mlxcel.server.json_body import decode_json_body
from mlxcel.server.llama_native.protocol import default_settings_flat, sampling_params_view
from mlxcel.server.ops.cache import reset_payload, stats_payload
from mlxcel.server.ops.metrics import CONTENT_TYPE, metrics_text
from mlxcel.server.state import ServerState, get_state

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.text.engine_state import EngineSnapshot, SlotState
    from mlxcel.server.engine_protocol import GenerationEngine

router = APIRouter()

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_TASK_ID = re.compile(r"(\d+)$")


def _modalities(state: ServerState) -> dict[str, bool]:
    """llama-server's `modalities`: which inputs besides text the loaded model takes."""
    kinds = state.media.modalities if state.media is not None else frozenset()
    return {"vision": "image" in kinds, "video": "video" in kinds, "audio": "audio" in kinds}


def metrics_enabled(settings: Settings) -> bool:
    """`/metrics` is served with `--metrics` or `--metrics-port`."""
    return bool(settings.metrics) or settings.metrics_port is not None


def _not_supported(message: str) -> APIError:
    return APIError(501, message, "not_supported_error")


def _engine(state: ServerState) -> GenerationEngine:
    engine = state.engine
    if engine is None:
        raise model_loading()
    return engine


def _default_params(state: ServerState) -> tuple[Any, int]:
    """(default SamplingParams, default n_predict) from the server settings."""
    settings = state.settings
    sampling = sampling_from_settings(settings, state.tokenizer)
    return sampling, settings.n_predict


# ----------------------------------------------------------------------------- /props


def model_file_name(state: ServerState) -> str:
    """`model_path` for /props: the model file's own name (a `.gguf` file), never a directory
    path; the served name for directories and cached repositories."""
    info = state.model_info
    if info is not None and info.path.suffix.lower() == ".gguf":
        return info.path.name
    return state.model_name


def props_payload(state: ServerState) -> dict[str, Any]:
    """GET /props in llama-server's shape (`model_path` is a file name, never a path)."""
    engine = _engine(state)
    settings = state.settings
    sampling, n_predict = _default_params(state)
    tokenizer = state.tokenizer
    template = tokenizer.chat_template if tokenizer is not None else None
    tools = supports_tools(template)
    name = state.model_name
    return {
        "default_generation_settings": {
            **default_settings_flat(sampling, n_predict),
            "params": sampling_params_view(
                sampling, n_predict=n_predict, ignore_eos=settings.ignore_eos
            ),
            "n_ctx": engine.context_per_slot,
        },
        "total_slots": engine.n_slots,
        "blas": blas_in_use(),
        "cpu_kernels": kernel_status(),
        "model_alias": name,
        "model_path": model_file_name(state),
        # mlxcel's: what the model is (general.architecture / model_type) and how it is stored
        "model_architecture": info.architecture if (info := state.model_info) else "",
        "model_quantization": info.quantization if info else "",
        # ranks the model is split across (`mlx.launch`); 1: this process holds all of it
        "world_size": int(info.extra.get("distributed", {}).get("world_size", 1)) if info else 1,
        "modalities": _modalities(state),
        "endpoint_slots": bool(settings.slots),
        "endpoint_props": bool(settings.props),
        "endpoint_metrics": metrics_enabled(settings),
        "ui": False,
        "ui_settings": {},
        "chat_template": template or "",
        "chat_template_caps": {
            "supports_object_arguments": False,
            "supports_parallel_tool_calls": tools,
            "supports_preserve_reasoning": "preserve_thinking" in (template or ""),
            "supports_reasoning_effort": False,
            "supports_string_content": True,
            "supports_system_role": True,
            "supports_tool_calls": tools,
            "supports_tools": tools,
            "supports_typed_content": False,
        },
        "bos_token": (tokenizer.bos_token if tokenizer is not None else None) or "",
        "eos_token": (tokenizer.eos_token if tokenizer is not None else None) or "",
        "build_info": f"mlxcel-{__version__}",
        "is_sleeping": engine.sleeping,
        "cors_proxy_enabled": False,
    }


@router.get("/props")
async def get_props(state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Server properties and default generation settings."""
    return props_payload(state)


@router.post("/props")
async def set_props(raw: Request, state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Accepted only with `--props` (as llama-server, nothing is changeable yet)."""
    if not state.settings.props:
        raise _not_supported(
            "This server does not support changing global properties. Start it with `--props`"
        )
    body = await raw.body()
    if body.strip():
        parsed = decode_json_body(body)
        if not isinstance(parsed, dict):
            raise bad_request("request body must be a JSON object")
    return {"success": True}


# ----------------------------------------------------------------------------- /slots


def _task_id(request_id: str | None) -> int:
    match = _TASK_ID.search(request_id or "")
    return int(match.group(1)) if match else -1


def _slot_entry(
    slot: SlotState, *, model: str, n_ctx: int, params: dict[str, Any], snap: EngineSnapshot
) -> dict[str, Any]:
    busy = slot.state != "idle"
    entry: dict[str, Any] = {
        "id": slot.id,
        "state": "decoding" if busy else "idle",
        "model": model,
        "context_size": n_ctx,
        "is_processing": busy,
        "n_ctx": n_ctx,
        "speculative": False,
        # mlxcel's: the KV cache type and its real bytes a token, and the slot's bytes now
        "kv_cache_type": snap.kv_type,
        "kv_bytes_per_token": snap.kv_bytes_per_token,
        "kv_bytes": (slot.n_prompt + slot.n_decoded) * snap.kv_bytes_per_token if busy else 0,
    }
    if not busy and not slot.used:
        return entry  # as llama-server: a slot that never ran a task has no task fields
    return {
        **entry,
        "id_task": _task_id(slot.request_id) if busy else -1,
        "n_prompt_tokens": slot.n_prompt,
        "n_prompt_tokens_processed": slot.n_prompt if slot.state == "decoding" else 0,
        "n_prompt_tokens_cache": 0,
        "params": params,
        "next_token": [
            {
                "has_next_token": busy,
                "has_new_line": False,
                "n_remain": -1,
                "n_decoded": slot.n_decoded,
            }
        ],
    }


def slots_payload(state: ServerState) -> list[dict[str, Any]]:
    """GET /slots: one entry per slot (decoding or idle), then one per queued request."""
    snap = _engine(state).snapshot()
    sampling, n_predict = _default_params(state)
    params = sampling_params_view(
        sampling, n_predict=n_predict, ignore_eos=state.settings.ignore_eos
    )
    model, n_ctx = state.model_name, snap.context_per_slot
    entries = [
        _slot_entry(s, model=model, n_ctx=n_ctx, params=params, snap=snap) for s in snap.slots
    ]
    for i, request_id in enumerate(snap.queued):
        entries.append(
            {
                "id": len(snap.slots) + i,
                "state": "queued",
                "model": model,
                "context_size": n_ctx,
                "is_processing": False,
                "n_ctx": n_ctx,
                "speculative": False,
                "id_task": _task_id(request_id),
            }
        )
    return entries


def _slots_enabled(state: ServerState) -> None:
    if not state.settings.slots:
        raise _not_supported("This server does not support slots endpoint. Start it with `--slots`")


@router.get("/slots")
async def get_slots(raw: Request, state: ServerState = Depends(get_state)) -> list[dict[str, Any]]:
    """Per-slot state; `?fail_on_no_slot=1` answers 503 when every slot is busy."""
    _slots_enabled(state)
    entries = slots_payload(state)
    fail = (raw.query_params.get("fail_on_no_slot") or "").strip().lower() in _TRUE_WORDS
    if fail and not any(e["state"] == "idle" for e in entries):
        raise server_busy("no slot available")
    return entries


# llama-server's answer fields per action: tokens, bytes, milliseconds
_SLOT_FIELDS = {
    "save": ("n_saved", "n_written", "save_ms"),
    "restore": ("n_restored", "n_read", "restore_ms"),
}


_SLOT_POLL_S = 0.05


async def _slot_idle(engine: GenerationEngine, slot: int, raw: Request) -> None:
    """Wait while `slot` runs a task, as llama-server defers a slot action until its slot
    is free: the action then sees the KV cache the task left (an erase answered at once
    forgot the old cache, and the task stored its own after it). A client that leaves ends
    the wait."""
    while engine.snapshot().slots[slot].state != "idle":
        if await raw.is_disconnected():
            raise ClientDisconnect
        await asyncio.sleep(_SLOT_POLL_S)


@router.post("/slots/{id_slot}")
async def slot_action(
    id_slot: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """`?action=save|restore` (`filename` in the body, a file of `--slot-save-path`) and
    `?action=erase`, llama-server's answers; the engine's `SlotFiles` does the work. As
    llama-server, `--slot-save-path` enables them whatever `--slots` says (the monitoring
    endpoint's switch); without it, erase needs `--slots`."""
    from mlxcel.engine.errors import InvalidRequestError
    from mlxcel.engine.text.slot_files import SlotFiles

    directory = state.settings.slot_save_path
    if not directory:
        _slots_enabled(state)
    engine = _engine(state)
    try:
        slot = int(id_slot)
    except ValueError:
        raise bad_request("Invalid slot ID") from None
    if not 0 <= slot < engine.n_slots:
        raise bad_request("Invalid slot ID")
    action = raw.query_params.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise bad_request("Invalid action")
    snap = engine.snapshot()
    files = SlotFiles(Path(directory or "."), state.prompt_cache, snap.kv_type, state.model_name)
    if action == "erase":
        await _slot_idle(engine, slot, raw)
        return {"id_slot": slot, "n_erased": files.erase(slot)}
    if not directory:
        raise _not_supported(
            "This server does not support slots action. Start it with `--slot-save-path`"
        )
    body = await raw.body()
    parsed = decode_json_body(body) if body.strip() else {}
    if not isinstance(parsed, dict):
        raise bad_request("request body must be a JSON object")
    filename = parsed.get("filename")
    await _slot_idle(engine, slot, raw)
    run = files.save if action == "save" else files.restore
    try:
        done = await asyncio.to_thread(run, slot, filename)
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from None
    tokens, size, ms = _SLOT_FIELDS[action]
    return {
        "id_slot": slot,
        "filename": done.filename,
        tokens: done.n_tokens,
        size: done.n_bytes,
        "timings": {ms: done.ms},
    }


# --------------------------------------------------------------------------- /metrics


def _metrics_response(state: ServerState, text: str | None = None) -> PlainTextResponse:
    # llama-server's header; here the server's start as Unix seconds, as its name says
    headers = {"Content-Type": CONTENT_TYPE, "Process-Start-Time-Unix": str(int(state.started))}
    return PlainTextResponse(metrics_text(state) if text is None else text, headers=headers)


@router.get("/metrics")
async def metrics(state: ServerState = Depends(get_state)) -> PlainTextResponse:
    """Prometheus metrics; without `--metrics`/`--metrics-port` 501, as llama-server."""
    if not metrics_enabled(state.settings):
        raise _not_supported(
            "This server does not support metrics endpoint. Start it with `--metrics`"
        )
    return _metrics_response(state)


def metrics_app(state: ServerState, text: Callable[[], str] | None = None) -> FastAPI:
    """The app served on `--metrics-port`: only GET /metrics (API keys still apply), whose
    body is `text()` (by default this server's metrics; a router's covers its models)."""
    from mlxcel.server.middleware import ApiKeys, RequestGuard

    app = FastAPI(title="mlxcel-metrics", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mlxcel = state
    install_error_handlers(app)

    @app.get("/metrics")
    async def _metrics() -> PlainTextResponse:
        return _metrics_response(state, None if text is None else text())

    app.add_middleware(
        RequestGuard,
        api_keys=ApiKeys(state.settings.api_keys()),
        public_paths=(),
        max_body_size=state.settings.max_body_size,
    )
    return app


# ---------------------------------------------------------------------- prompt cache


@router.get("/v1/cache/stats")
async def cache_stats(state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Prompt-cache counters (a stable disabled payload when the cache is off)."""
    cache = state.prompt_cache
    return stats_payload(cache.stats() if cache is not None else None)


@router.post("/v1/cache/reset")
async def cache_reset(state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Drop every prompt-cache entry (idempotent)."""
    cache = state.prompt_cache
    return reset_payload(cache.reset() if cache is not None else None)
