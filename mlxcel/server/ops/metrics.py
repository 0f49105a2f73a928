"""Prometheus text for GET /metrics: the spec's `mlxcel_*` families and llama-server's own.

The `mlxcel_*` names, help and types are the spec's; the `llamacpp:*` families are
llama-server's (names, help text, counter or gauge, in its order), so that dashboards and
scrapers built for it keep working, plus the prompt-cache pair newer llama-servers add
(`prompt_tokens_cache_total`, `prompt_cache_hit_ratio`). The request and token counters of
both are the sums of what the finished requests' `usage` and `timings` said
(`RequestCounters`, counted by `mlxcel.server.generation` on every route; embedding
prompts count as processed prompt tokens); as in llama-server, generation time starts at
the first token, so the generation rate leaves the first token's wait out. The slot, queue
and batch families come from the engine's snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxcel.engine.text.engine_state import EngineCounters
    from mlxcel.server.state import ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Family:
    """One metric family with a single unlabelled sample."""

    name: str
    type: str  # "counter" | "gauge"
    help: str
    value: float


def _format(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def render(families: list[Family]) -> str:
    """The Prometheus text exposition (format 0.0.4) of `families`."""
    blocks = [
        f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.type}\n{f.name} {_format(f.value)}\n"
        for f in families
    ]
    return "\n".join(blocks)


def _label_value(text: str) -> str:
    """`text` as a quoted label value may hold it (backslash, quote and newline escaped)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_labelled(label: str, groups: dict[str, list[Family]]) -> str:
    """The exposition of `groups` as one labelled series each: every family once (in the
    first group's order), with one sample per group, `name{label="key"} value`."""
    order: dict[str, Family] = {}
    samples: dict[str, list[str]] = {}
    for key, families in groups.items():
        for f in families:
            order.setdefault(f.name, f)
            line = f'{f.name}{{{label}="{_label_value(key)}"}} {_format(f.value)}'
            samples.setdefault(f.name, []).append(line)
    blocks = [
        f"# HELP {name} {f.help}\n# TYPE {name} {f.type}\n" + "\n".join(samples[name]) + "\n"
        for name, f in order.items()
    ]
    return "\n".join(blocks)


def _ratio(amount: float, per: float) -> float:
    """`amount / per`, 0 when `per` is 0 (a gauge never reads NaN)."""
    return amount / per if per > 0 else 0.0


def collect(state: ServerState) -> list[Family]:
    """Every family, read from the request counters and the engine snapshot."""
    http = state.counters
    n_slots = busy = queued = 0
    engine: EngineCounters | None = None
    if state.engine is not None:
        snap = state.engine.snapshot()
        engine = snap.counters
        n_slots = len(snap.slots)
        busy = sum(1 for slot in snap.slots if slot.state != "idle")
        queued = len(snap.queued)

    def engine_value(name: str, default: float = 0) -> float:
        value = getattr(engine, name, default) if engine is not None else default
        return value if isinstance(value, (int, float)) else default

    prefill_tokens = engine_value("prefill_tokens_total")
    decode_tokens = engine_value("decode_tokens_total")
    decode_steps = engine_value("decode_steps")
    busy_per_decode = engine_value("busy_slots_per_decode_total")
    prompt_seconds = float(http.prompt_seconds_total)
    predicted_seconds = float(http.predicted_seconds_total)

    ours = [
        Family(
            "mlxcel_requests_total",
            "counter",
            "Total number of completed generation requests; chat completion streams "
            "cancelled by the client are excluded",
            http.requests_total,
        ),
        Family(
            "mlxcel_prompt_tokens_total",
            "counter",
            "Total prompt tokens processed",
            http.prompt_tokens_total,
        ),
        Family(
            "mlxcel_completion_tokens_total",
            "counter",
            "Total completion tokens of the requests counted in mlxcel_requests_total",
            http.completion_tokens_total,
        ),
        Family(
            "mlxcel_generation_time_seconds_total",
            "counter",
            "Total generation time in seconds",
            float(http.generation_seconds_total),
        ),
        Family("mlxcel_slots_total", "gauge", "Total number of parallel slots", n_slots),
        Family("mlxcel_slots_available", "gauge", "Available parallel slots", n_slots - busy),
        Family("mlxcel_queue_depth", "gauge", "Current prefill queue depth", queued),
        Family(
            "mlxcel_batch_sequences_started",
            "counter",
            "Total sequences that entered prefill",
            engine_value("sequences_started"),
        ),
        Family(
            "mlxcel_batch_sequences_completed",
            "counter",
            "Total sequences that completed generation",
            engine_value("sequences_completed"),
        ),
        Family(
            "mlxcel_batch_prefill_tokens_total",
            "counter",
            "Cumulative prefill tokens processed",
            prefill_tokens,
        ),
        Family(
            "mlxcel_batch_decode_tokens_total",
            "counter",
            "Cumulative decode tokens generated",
            decode_tokens,
        ),
        Family("mlxcel_batch_current_size", "gauge", "Current active batch size", busy),
        Family("mlxcel_cache_pool_active", "gauge", "Active cache entries", busy),
    ]
    processed = http.prompt_tokens_processed
    cached = http.prompt_tokens_cached
    # llama-server's families, names, help and order (its counters, then its gauges), then
    # the prompt-cache pair newer llama-servers add.
    llama = [
        Family(
            "llamacpp:prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            processed,
        ),
        Family("llamacpp:prompt_seconds_total", "counter", "Prompt process time", prompt_seconds),
        Family(
            "llamacpp:tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            http.tokens_predicted,
        ),
        Family(
            "llamacpp:tokens_predicted_seconds_total",
            "counter",
            "Predict process time",
            predicted_seconds,
        ),
        Family(
            "llamacpp:n_decode_total",
            "counter",
            "Total number of llama_decode() calls",
            decode_steps,
        ),
        Family(
            "llamacpp:n_tokens_max",
            "counter",
            "Largest observed n_tokens.",
            engine_value("n_tokens_max"),
        ),
        Family(
            "llamacpp:spec_decode_num_draft_tokens_total",
            "counter",
            "Total draft tokens generated",
            http.draft_tokens,
        ),
        Family(
            "llamacpp:spec_decode_num_accepted_tokens_total",
            "counter",
            "Total draft tokens accepted by the target model",
            http.draft_tokens_accepted,
        ),
        Family(
            "llamacpp:spec_decode_num_drafts_total",
            "counter",
            "Total speculative decoding verification steps",
            http.draft_rounds,
        ),
        Family(
            "llamacpp:prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            _ratio(processed, prompt_seconds),
        ),
        Family(
            "llamacpp:predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            _ratio(http.tokens_predicted, predicted_seconds),
        ),
        Family(
            "llamacpp:requests_processing",
            "gauge",
            "Number of requests processing.",
            busy,
        ),
        Family(
            "llamacpp:requests_deferred",
            "gauge",
            "Number of requests deferred.",
            queued,
        ),
        Family(
            "llamacpp:n_busy_slots_per_decode",
            "gauge",
            "Average number of busy slots per llama_decode() call",
            busy_per_decode / max(decode_steps, 1),
        ),
        Family(
            "llamacpp:prompt_tokens_cache_total",
            "counter",
            "Number of prompt tokens reused from the prompt cache.",
            cached,
        ),
        Family(
            "llamacpp:prompt_cache_hit_ratio",
            "gauge",
            "Share of prompt tokens served from the prompt cache.",
            _ratio(cached, cached + processed),
        ),
    ]
    return ours + llama


def metrics_text(state: ServerState) -> str:
    """The full `/metrics` body."""
    return render(collect(state))
