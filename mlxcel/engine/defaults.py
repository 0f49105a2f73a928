"""Turn resolved settings into the engine's per-request defaults."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxcel.config import process_env
from mlxcel.engine.sampling.params import SAMPLING_KNOBS, SamplingParams
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
    values: dict[str, Any] = {"dry_sequence_breakers": breakers}
    for knob in SAMPLING_KNOBS:  # the one table of knobs: each one's server setting
        if knob.setting:
            default = knob.value(getattr(settings, knob.setting))
            values.update((param, default) for param in knob.params)
    values.update({k: v for k, v in overrides.items() if v is not None})
    params = SamplingParams(**values)
    params.validate()
    return params


def check_sampling_settings(settings: Settings) -> None:
    """Raise ValueError (one line naming the option) for a sampling default a request would
    be refused with, so a server never starts that would refuse every request."""
    from mlxcel.config.llama_flags import cli_label

    for knob in SAMPLING_KNOBS:
        if knob.setting:
            value = knob.value(getattr(settings, knob.setting))
            if value is not None:
                knob.check_range(cli_label(knob.setting), value)


def loop_params(
    settings: Settings,
    family: str | None,
    *,
    max_pattern_size: int | None = None,
    min_pattern_size: int | None = None,
    min_count: int | None = None,
) -> LoopParams | None:
    """Loop detection for one request: request values > MLXCEL_LOOP_DETECTION > family."""
    env_value = settings.loop_detection or process_env.loop_detection()
    return resolve_loop_params(
        max_pattern_size=max_pattern_size,
        min_pattern_size=min_pattern_size,
        min_count=min_count,
        env_value=env_value,
        model_family=family,
    )
