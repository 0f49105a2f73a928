"""Errors of the side workers (embeddings, rerank): each maps to one HTTP status."""

from __future__ import annotations

from mlxcel.engine.errors import EngineError


class WorkerTimeoutError(EngineError):
    """A job waited or ran past its deadline (maps to HTTP 504)."""


class WorkerStoppedError(EngineError):
    """The worker was stopped before it could run the job (maps to HTTP 503)."""


class WorkerCrashedError(EngineError):
    """The worker died while running the job; it was restarted (maps to HTTP 500)."""
