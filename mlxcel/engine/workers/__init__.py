"""Side workers: threads with bounded queues that run non-text models next to the engine."""

from mlxcel.engine.workers.batch_worker import BatchItem, BatchWorker, WorkerStats
from mlxcel.engine.workers.embedding_worker import EmbeddingWorker
from mlxcel.engine.workers.errors import WorkerStoppedError, WorkerTimeoutError

__all__ = [
    "BatchWorker",
    "EmbeddingWorker",
    "BatchItem",
    "WorkerStats",
    "WorkerStoppedError",
    "WorkerTimeoutError",
]
