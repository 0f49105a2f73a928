"""A side worker that dies mid-request: that request gets a clean 5xx, the worker restarts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.testclient import TestClient
from fixtures.server_state import serve_side_models
from fixtures.tiny_encoders import GatedEmbedder

from mlxcel.engine.embeddings.embedder import TokenizedInput
from mlxcel.engine.workers import EmbeddingWorker
from mlxcel.engine.workers.batch_worker import BatchItem, BatchWorker
from mlxcel.server.embeddings.routes import router as embeddings_router
from mlxcel.server.embeddings.services import EmbeddingServices
from mlxcel.server.embeddings.serving import EmbeddingService
from mlxcel.server.errors import install_error_handlers


class WorkerKilled(BaseException):
    """What ends a worker thread outright (not an ordinary, per-job Exception)."""


class DyingEmbedder(GatedEmbedder):
    """Dies (raises WorkerKilled) on its first batch, then works."""

    def __init__(self) -> None:
        super().__init__()
        self.gate.set()
        self.deaths = 0

    def forward(self, batch: Sequence[TokenizedInput], pooling: str) -> list[Any]:
        if self.deaths == 0:
            self.deaths += 1
            raise WorkerKilled
        return super().forward(batch, pooling)


def test_a_worker_killed_mid_request_answers_500_and_restarts() -> None:
    worker = EmbeddingWorker(embedder=DyingEmbedder()).start()
    services = EmbeddingServices(
        embeddings=EmbeddingService(worker, model_name="dying", timeout=20), workers=[worker]
    )
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(embeddings_router)
    serve_side_models(app, embeddings=services)
    try:
        with TestClient(app) as client:
            first = client.post("/v1/embeddings", json={"input": "hello", "model": "dying"})
            assert first.status_code == 500, first.text
            error = first.json()["error"]
            assert error["type"] == "server_error" and "Traceback" not in error["message"]
            second = client.post("/v1/embeddings", json={"input": "hello", "model": "dying"})
            assert second.status_code == 200, second.text
            assert len(second.json()["data"][0]["embedding"]) == 3
        assert worker.worker.running
        assert worker.worker.stats.restarts == 1
    finally:
        services.stop()


def test_a_worker_whose_thread_ended_is_restarted_on_the_next_job() -> None:
    worker = BatchWorker("ended").start()
    worker._queue.wake()  # the thread ends as if stopped, but nobody stopped it
    assert worker._thread is not None
    worker._thread.join(5)
    assert not worker.running
    job = BatchItem(
        prepare=lambda: [[1, 2]],
        forward=lambda batch: [np.asarray(x).sum() for x in batch],
        finish=lambda outs: int(outs[0]),
        key="k",
    )
    try:
        assert worker.submit(job).result(10) == 3
        assert worker.running and worker.stats.restarts == 1
    finally:
        worker.stop()


def test_an_audio_job_that_kills_the_worker_answers_500_and_the_next_job_runs() -> None:
    import asyncio

    import pytest

    from mlxcel.engine.workers.audio import AudioModels, AudioWorker
    from mlxcel.server.bridge import await_engine
    from mlxcel.server.errors import APIError

    worker = AudioWorker(loader=AudioModels, timeout=20).start()

    def dies(models: AudioModels, stop: Any) -> str:
        raise WorkerKilled

    try:
        with pytest.raises(APIError) as caught:
            asyncio.run(await_engine(lambda: worker.submit(dies), worker.timeout))
        assert caught.value.status == 500
        assert worker.running
        ok = await_engine(lambda: worker.submit(lambda models, stop: "ok"), worker.timeout)
        assert asyncio.run(ok) == "ok"
    finally:
        worker.stop()
