"""Engine exceptions: each carries a one-line message fit for a user."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's errors."""


class ModelLoadError(EngineError, ValueError):
    """A model reference could not be resolved or loaded."""


class InvalidRequestError(EngineError, ValueError):
    """A generation request is malformed or does not fit the model (maps to HTTP 400)."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the requested tokens) does not fit the slot's context; the
    prompt's token count and the context size, when known (llama-server reports both)."""

    def __init__(
        self, message: str, *, n_prompt_tokens: int | None = None, n_ctx: int | None = None
    ) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class QueueFullError(EngineError):
    """The prefill queue is at its depth limit (maps to HTTP 503)."""


class RequestMemoryBudgetError(EngineError):
    """A request's estimated memory exceeds the request memory budget (maps to HTTP 503)."""

    def __init__(self, estimated_bytes: int, budget_bytes: int) -> None:
        super().__init__(
            f"request_memory_budget_exceeded: estimated_bytes={estimated_bytes}, "
            f"budget_bytes={budget_bytes}; shorten the prompt/output or lower retained cache usage"
        )
        self.estimated_bytes = estimated_bytes
        self.budget_bytes = budget_bytes
