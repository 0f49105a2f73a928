"""What every engine does the same way with a request it is handed: check it, and yield its
events to a caller that wants to iterate (the CLI, tests)."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from mlxcel.engine.errors import ContextLengthError, InvalidRequestError
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest

Sink = Callable[[GenerationEvent], None]


def token_budget(
    request: GenerationRequest, context_per_slot: int, vocab_size: int | None = None
) -> int:
    """Validate `request` against the context (and the vocabulary, when given); return how
    many tokens it may generate."""
    n_prompt = len(request.prompt_tokens)
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty")
    if vocab_size is not None:
        bad = next((t for t in request.prompt_tokens if t < 0 or t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"the prompt contains token id {bad}, out of vocabulary range "
                f"(vocab_size {vocab_size})"
            )
    if n_prompt >= context_per_slot:
        raise ContextLengthError(
            f"the request exceeds the available context size: {n_prompt} prompt tokens, "
            f"context is {context_per_slot} tokens per slot",
            n_prompt_tokens=n_prompt,
            n_ctx=context_per_slot,
        )
    budget = context_per_slot - n_prompt
    if request.max_tokens is not None:
        if request.max_tokens < 0:
            raise InvalidRequestError("max_tokens must be >= 0")
        budget = min(budget, request.max_tokens)
    return budget


def check_slot(request: GenerationRequest, n_slots: int) -> None:
    """InvalidRequestError when the request asks for a slot (`id_slot`) the engine does not
    have (-1 is any slot)."""
    if not -1 <= request.id_slot < n_slots:
        raise InvalidRequestError(
            f"id_slot {request.id_slot} is out of range: this server has {n_slots} slots "
            f"(0 to {n_slots - 1}, or -1 for any)"
        )


def iterate_events(
    submit: Callable[[GenerationRequest, Sink], None],
    cancel: Callable[[str], None],
    request: GenerationRequest,
) -> Iterator[GenerationEvent]:
    """Submit `request` and yield its events in order; cancel it if the caller stops early."""
    events: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    submit(request, events.put)
    try:
        while True:
            event = events.get()
            yield event
            if event.finished:
                return
    finally:
        cancel(request.request_id)
