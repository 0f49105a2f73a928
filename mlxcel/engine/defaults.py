"""Turn resolved settings into the engine's per-request defaults."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.loop_detection import LoopParams, resolve_loop_params

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.tokenizer import Tokenizer


def sampling_from_settings(
    settings: Settings, tokenizer: Tokenizer | None = None, **overrides: Any
) -> SamplingParams:
    """The server/CLI default sampling parameters, with request `overrides` applied."""
    breakers: tuple[int, ...] = ()
    if tokenizer is not None and settings.dry_multiplier > 0:
        ids: set[int] = set()
        for text in settings.dry_sequence_breaker:
            ids.update(tokenizer.encode(text, add_special=False))
        breakers = tuple(sorted(ids))
    values: dict[str, Any] = {
        "temperature": settings.temp,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "min_p": settings.min_p,
        "repetition_penalty": settings.repeat_penalty,
        "repetition_context_size": settings.repeat_last_n,
        "penalty_context_size": settings.repeat_last_n,
        "presence_penalty": settings.presence_penalty,
        "frequency_penalty": settings.frequency_penalty,
        "dry_multiplier": settings.dry_multiplier,
        "dry_base": settings.dry_base,
        "dry_allowed_length": settings.dry_allowed_length,
        "dry_penalty_last_n": settings.dry_penalty_last_n,
        "dry_sequence_breakers": breakers,
        "xtc_probability": settings.xtc_probability,
        "xtc_threshold": settings.xtc_threshold,
        "seed": None if settings.seed < 0 else settings.seed,
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    params = SamplingParams(**values)
    params.validate()
    return params


def loop_params(
    settings: Settings,
    family: str | None,
    *,
    max_pattern_size: int | None = None,
    min_pattern_size: int | None = None,
    min_count: int | None = None,
) -> LoopParams | None:
    """Loop detection for one request: request values > MLXCEL_LOOP_DETECTION > family."""
    env_value = settings.loop_detection or os.environ.get("MLXCEL_LOOP_DETECTION")
    return resolve_loop_params(
        max_pattern_size=max_pattern_size,
        min_pattern_size=min_pattern_size,
        min_count=min_count,
        env_value=env_value,
        model_family=family,
    )
