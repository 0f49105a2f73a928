"""What the engine shows of itself to the observability routes: counters, slots, queue."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Cumulative counters for `/metrics`."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    generation_seconds_total: float = 0.0
    sequences_started: int = 0
    sequences_completed: int = 0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prompt_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    busy_slots_per_decode_total: int = 0  # sum over decode steps of the slots they advanced
    n_tokens_max: int = 0  # the most tokens (prompt + generated) any request held
    busy_slots_max: int = 0


@dataclass(frozen=True)
class SlotState:
    """What one slot is doing, for `/slots` and `/health`."""

    id: int
    state: str  # "idle" | "decoding" | "prefilling"
    request_id: str | None = None
    n_prompt: int = 0
    n_decoded: int = 0
    used: bool = False  # has run a request since the engine started


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent view of the engine for the observability routes."""

    slots: tuple[SlotState, ...]
    queued: tuple[str, ...]
    counters: EngineCounters
    context_per_slot: int
    kv_type: str = ""  # `-ctk/-ctv` ("": the model's dtype)
    kv_bytes_per_token: int = 0  # keys and values of one token, every layer (0: unknown)
    failure: str = ""  # why the engine refuses work (a broken group of ranks); "": it works
