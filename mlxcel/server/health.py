"""GET /health (and /): liveness, loading state, batch and observability figures."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.responses import JSONResponse

from mlxcel.engine.chat.tool_calls import detect_format
from mlxcel.server.errors import RETRY_AFTER_SECONDS
from mlxcel.server.state import ServerState, get_state

router = APIRouter()

TOOL_CALL_PARSER = "mlxcel"


def supports_tools(chat_template: str | None) -> bool:
    """Whether the server parses tool calls for a chat template (a known format, or tools)."""
    return detect_format(str(chat_template) if chat_template else None) is not None


_draining: set[int] = set()  # id() of the states whose server is draining


def set_draining(state: ServerState) -> None:
    """Mark `state`'s server as draining: `/health` answers 503 from now on."""
    _draining.add(id(state))


def is_draining(state: ServerState) -> bool:
    """Whether `state`'s server got a stop signal and is finishing its requests."""
    return id(state) in _draining


def health_payload(state: ServerState) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of the health check, as the spec shows them."""
    if is_draining(state):
        return 503, {"status": "draining", "tool_call_parser": None}
    if state.loading:
        return 503, {"status": "loading model", "tool_call_parser": None}
    engine = state.engine
    if engine is None:  # side models only (embeddings, audio, image): no slots
        names = state.side_model_names
        return 200, {
            "status": "ok",
            "model": state.model_name,
            "models": names,
            "tool_call_parser": None,
        }
    snap = engine.snapshot()
    if snap.failure:  # e.g. a rank of a distributed model is gone: no work can run
        return 503, {"status": "unavailable", "error": snap.failure, "tool_call_parser": None}
    active = sum(1 for slot in snap.slots if slot.state != "idle")
    counters = snap.counters
    full = active >= len(snap.slots)
    template = state.tokenizer.chat_template if state.tokenizer is not None else None
    body = {
        "status": "no slot available" if full else "ok",
        "model": state.model_name,
        "batch": {
            "active_sequences": active,
            "queue_depth": len(snap.queued),
            "max_batch_size": len(snap.slots),
        },
        "observability": {
            "sequences_started": counters.sequences_started,
            "sequences_completed": counters.sequences_completed,
            "total_prefill_tokens": counters.prefill_tokens_total,
            "total_decode_tokens": counters.decode_tokens_total,
            "decode_steps_processed": int(getattr(counters, "decode_steps", 0)),
            "prefill_chunks_processed": int(getattr(counters, "prefill_chunks", 0)),
            "current_batch_size": active,
            "cache_pool_active": active,
        },
        "context_size": snap.context_per_slot,
        "tool_call_parser": TOOL_CALL_PARSER if supports_tools(template) else None,
    }
    return (503 if full else 200), body


@router.get("/health")
@router.get("/")
async def health(state: ServerState = Depends(get_state)) -> JSONResponse:
    """Health check; 503 while loading, draining, or when every slot is busy."""
    status, body = health_payload(state)
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)
