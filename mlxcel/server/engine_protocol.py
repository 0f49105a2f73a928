"""What the server needs of the generation engine it runs, as one protocol.

`TextEngine` and `VisionEngine` both have this face; the routes, the bridge and the
observability endpoints ask it (through `ServerState.engine`) and nothing else of an
engine, so the server never depends on an engine's concrete class or reaches into it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mlxcel.engine.text.engine_state import EngineSnapshot
    from mlxcel.engine.text.request import GenerationEvent, GenerationRequest


class GenerationEngine(Protocol):
    """A running text (or vision-language) engine: submit and cancel requests, read its
    slots and counters, wake it from idle sleep, stop it."""

    @property
    def n_slots(self) -> int:
        """Requests it runs at once."""
        ...

    @property
    def context_per_slot(self) -> int:
        """Tokens one request may hold (prompt and generated)."""
        ...

    @property
    def flushes_sinks(self) -> bool:
        """Whether a sink's `flush()` is called once after each step that gave it events."""
        ...

    @property
    def sleeping(self) -> bool:
        """Whether the model is unloaded after an idle spell (`--sleep-idle-seconds`)."""
        ...

    def submit(self, request: GenerationRequest, sink: Callable[[GenerationEvent], None]) -> None:
        """Queue `request` (QueueFullError, InvalidRequestError, ... when refused)."""
        ...

    def cancel(self, request_id: str) -> None:
        """End a queued or running request as cancelled."""
        ...

    def snapshot(self) -> EngineSnapshot:
        """Its slots, queue and counters, read consistently."""
        ...

    def wake(self) -> Future[None]:
        """Reload a sleeping model; the future resolves once it is back."""
        ...

    def stop(self) -> None:
        """Stop its thread; queued and running requests end as cancelled."""
        ...
