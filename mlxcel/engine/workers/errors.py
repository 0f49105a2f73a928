"""Errors of the side workers (embeddings, rerank, audio, images): each maps to one HTTP
status (the table is `mlxcel.server.bridge.engine_error_answer`)."""

from __future__ import annotations

from mlxcel.engine.errors import EngineError


class WorkerTimeoutError(EngineError):
    """A job waited or ran past its deadline (maps to HTTP 504)."""

    @classmethod
    def after(cls, seconds: float) -> WorkerTimeoutError:
        """The error of a job that did not finish within `seconds`."""
        return cls(f"the request timed out after {seconds:g} s")


class WorkerStoppedError(EngineError):
    """The worker was stopped before it could run the job (maps to HTTP 503)."""


class WorkerCrashedError(EngineError):
    """The worker died while running the job; it was restarted (maps to HTTP 500)."""
