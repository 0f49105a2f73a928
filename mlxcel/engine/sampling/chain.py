"""Build a request's sampler and logits processors from its `SamplingParams`."""

from __future__ import annotations

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.processors import (
    LogitsProcessor,
    make_dry,
    make_frequency_presence_penalty,
    make_logit_bias,
    make_repetition_penalty,
)
from mlxcel.engine.sampling.samplers import Sampler, make_sampler


def make_logits_processors(params: SamplingParams, vocab_size: int) -> list[LogitsProcessor]:
    """The processors that are not no-ops, in llama.cpp's order: bias, penalties, DRY."""
    candidates = (
        make_logit_bias(params.logit_bias, vocab_size),
        make_repetition_penalty(params.repetition_penalty, params.repetition_context_size),
        make_frequency_presence_penalty(
            params.frequency_penalty, params.presence_penalty, params.penalty_context_size
        ),
        make_dry(
            params.dry_multiplier,
            params.dry_base,
            params.dry_allowed_length,
            params.dry_penalty_last_n,
            params.dry_sequence_breakers,
        ),
    )
    return [p for p in candidates if p is not None]


def make_sampling(params: SamplingParams, vocab_size: int) -> tuple[Sampler, list[LogitsProcessor]]:
    """Validate `params` and build `(sampler, logits_processors)` for one request.

    Both are for the engine's `DecodeBatch.insert(samplers=[s], logits_processors=[ps])`
    (or mlx-lm's `generate_step`). Build them per request: the sampler owns the seeded
    random key and the DRY processor caches the context it has seen. Raises ValueError for
    invalid params.
    """
    params.validate()
    return make_sampler(params), make_logits_processors(params, vocab_size)
