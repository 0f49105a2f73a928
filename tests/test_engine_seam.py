"""The one engine-to-HTTP seam (`mlxcel.server.bridge`): every worker family (embeddings,
rerank, audio, images; text for the queue) answers the same engine failure the same way.

Each family runs its real worker thread on a scripted model that blocks on a gate or dies
mid-request, behind its real routes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from fixtures.audio import until_stopped
from fixtures.server_state import serve_side_models
from fixtures.stand_in_engine import StandInEngine
from fixtures.tiny_encoders import GatedEmbedder
from httpx import Response

from mlxcel.engine.audio.phonemize import PhonemizerUnavailable
from mlxcel.engine.embeddings import reranker_for
from mlxcel.engine.embeddings.tokenization import TokenizedInput
from mlxcel.engine.errors import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    QueueFullError,
    RequestMemoryBudgetError,
)
from mlxcel.engine.image import GeneratedPicture, ImageRequest
from mlxcel.engine.text.request import GenerationRequest
from mlxcel.engine.workers import EmbeddingWorker
from mlxcel.engine.workers.audio import AudioModels, AudioUnavailableError, AudioWorker
from mlxcel.engine.workers.errors import (
    WorkerCrashedError,
    WorkerStoppedError,
    WorkerTimeoutError,
)
from mlxcel.engine.workers.image_worker import ImageWorker
from mlxcel.server.audio import router as audio_router
from mlxcel.server.bridge import EngineClient, await_engine, engine_error_answer
from mlxcel.server.embeddings.routes import router as embeddings_router
from mlxcel.server.embeddings.services import EmbeddingServices
from mlxcel.server.embeddings.serving import EmbeddingService
from mlxcel.server.errors import APIError, install_error_handlers
from mlxcel.server.images.routes import router as images_router
from mlxcel.server.rerank.routes import router as rerank_router
from mlxcel.server.rerank.serving import RerankService

SPEC_BUSY = "All slots are busy. Please try again later."
"""The 503 message of /work/shared/spec/rest-api.ko.md (error section)."""

FAMILIES = ["embeddings", "rerank", "audio", "images"]


class WorkerKilled(BaseException):
    """What ends a worker thread outright (not a per-job Exception)."""


class ScriptedEmbedder(GatedEmbedder):
    """A GatedEmbedder that dies on every batch when `crash`."""

    def __init__(self, *, crash: bool) -> None:
        super().__init__()
        self.crash = crash

    def forward(self, batch: Sequence[TokenizedInput], pooling: str) -> list[Any]:
        self.entered.set()
        if self.crash:
            raise WorkerKilled
        return super().forward(batch, pooling)


class ScriptedImageModel:
    """The part of `ImageModel` the image worker uses: waits for `gate`, or dies."""

    name = "scripted"

    def __init__(self, *, crash: bool) -> None:
        self.crash = crash
        self.gate = threading.Event()
        self.entered = threading.Event()

    def check(self, job: ImageRequest) -> None:
        pass

    def generate(self, job: ImageRequest, **_: Any) -> list[GeneratedPicture]:
        self.entered.set()
        if self.crash:
            raise WorkerKilled
        self.gate.wait(30)
        return [GeneratedPicture(png=b"", width=job.width, height=job.height, seed=job.seed)]


@dataclass
class Family:
    """One worker family behind its routes, with a scripted model."""

    app: FastAPI
    send: Callable[[TestClient], Response]  # one request on the family's route
    occupy: Callable[[], None]  # one job running (blocked) and one waiting
    release: Callable[[], None]  # open the gate
    stop: Callable[[], None]


def _app(*routers: Any) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    return app


def _embedding_family(kind: str, crash: bool, timeout: float | None, depth: int) -> Family:
    fake = ScriptedEmbedder(crash=crash)
    if kind == "embeddings":
        worker = EmbeddingWorker(embedder=fake, batch_size=1, queue_depth=depth).start()
        services = EmbeddingServices(
            embeddings=EmbeddingService(worker, model_name="fake", timeout=timeout),
            workers=[worker],
        )

        def submit() -> Future[Any]:
            return worker.embed(["abc"])

        def send(client: TestClient) -> Response:
            return client.post("/v1/embeddings", json={"input": "abc"})

    else:
        worker = EmbeddingWorker(reranker=reranker_for(fake), batch_size=1, queue_depth=depth)
        worker.start()
        services = EmbeddingServices(
            rerank=RerankService(worker, model_name="fake", timeout=timeout), workers=[worker]
        )

        def submit() -> Future[Any]:
            return worker.rerank("a", ["abc"])

        def send(client: TestClient) -> Response:
            return client.post("/v1/rerank", json={"query": "a", "documents": ["abc"]})

    app = _app(embeddings_router, rerank_router)
    serve_side_models(app, embeddings=services)

    def occupy() -> None:
        submit()
        assert fake.entered.wait(10)
        submit()

    return Family(app, send, occupy, fake.gate.set, services.stop)


def _audio_family(crash: bool, timeout: float | None, depth: int) -> Family:
    gate, entered = threading.Event(), threading.Event()
    worker = AudioWorker(
        loader=lambda: AudioModels(tts=object()),  # type: ignore[arg-type]
        queue_depth=depth,
        timeout=timeout,
    ).start()

    def job(_models: AudioModels, _stop: Callable[[], bool]) -> Any:
        entered.set()
        if crash:
            raise WorkerKilled
        gate.wait(30)
        return None

    worker.speak = lambda *_a, **_k: worker.submit(job)  # type: ignore[method-assign]
    app = _app(audio_router)
    serve_side_models(app, audio=worker)

    def occupy() -> None:
        worker.submit(job)
        assert entered.wait(10)
        worker.submit(job)

    def send(client: TestClient) -> Response:
        return client.post("/v1/audio/speech", json={"input": "hi"})

    return Family(app, send, occupy, gate.set, worker.stop)


def _image_family(crash: bool, timeout: float | None, depth: int) -> Family:
    model = ScriptedImageModel(crash=crash)
    worker = ImageWorker(model, queue_depth=depth, timeout=timeout).start()  # type: ignore[arg-type]
    app = _app(images_router)
    serve_side_models(app, image=worker)
    job = ImageRequest(prompt="x", width=16, height=16)

    def occupy() -> None:
        worker.submit(job)
        assert model.entered.wait(10)
        worker.submit(job)

    def send(client: TestClient) -> Response:
        return client.post("/v1/images/generations", json={"prompt": "x", "size": "16x16"})

    return Family(app, send, occupy, model.gate.set, worker.stop)


@pytest.fixture
def family_of() -> Iterator[Callable[..., Family]]:
    """Builds a family (`crash`: the model dies; `timeout`; queue `depth`); stops them all."""
    built: list[Family] = []

    def build(
        name: str, *, crash: bool = False, timeout: float | None = None, depth: int = 4
    ) -> Family:
        if name in ("embeddings", "rerank"):
            family = _embedding_family(name, crash, timeout, depth)
        elif name == "audio":
            family = _audio_family(crash, timeout, depth)
        else:
            family = _image_family(crash, timeout, depth)
        built.append(family)
        return family

    yield build
    for family in built:
        family.release()
        family.stop()


def _error(response: Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


# --------------------------------------------------------------------------- the table


@pytest.mark.parametrize(
    ("exc", "status", "type_"),
    [
        (QueueFullError("8 requests already waiting"), 503, "server_busy"),
        (RequestMemoryBudgetError(10, 5), 503, "request_memory_budget_exceeded"),
        (WorkerStoppedError("stopped"), 503, "unavailable_error"),
        (WorkerTimeoutError.after(2), 504, "timeout_error"),
        (WorkerCrashedError("died; restarted"), 500, "server_error"),
        (AudioUnavailableError("no speech-to-text model"), 501, "not_implemented"),
        (PhonemizerUnavailable("no phonemizer"), 501, "not_supported_error"),
        (ContextLengthError("too long", n_prompt_tokens=9, n_ctx=4), 400, "invalid_request_error"),
        (InvalidRequestError("bad"), 400, "invalid_request_error"),
    ],
)
def test_each_engine_error_has_one_answer(exc: EngineError, status: int, type_: str) -> None:
    answer = engine_error_answer(exc)
    assert answer is not None
    assert (answer.status, answer.type) == (status, type_)
    if isinstance(exc, QueueFullError):
        assert answer.message == SPEC_BUSY and answer.headers == {"Retry-After": "1"}
    elif isinstance(exc, ContextLengthError):
        assert answer.code == "context_length_exceeded"
        assert answer.extra == {"n_prompt_tokens": 9, "n_ctx": 4}
    elif not isinstance(exc, RequestMemoryBudgetError):
        assert answer.message == str(exc)


def test_an_engine_error_without_an_answer_stays_unexpected() -> None:
    assert engine_error_answer(EngineError("?")) is None


# --------------------------------------------------------------------------- every family


@pytest.mark.parametrize("name", FAMILIES)
def test_a_worker_that_dies_mid_request_answers_500_server_error(
    name: str, family_of: Callable[..., Family]
) -> None:
    """The same answer for every family (images used to answer it as an unexpected error,
    `internal error (WorkerCrashedError)` with `Connection: close`)."""
    family = family_of(name, crash=True, timeout=20)
    with TestClient(family.app) as client:
        response = family.send(client)
    error = _error(response, 500)
    assert error["type"] == "server_error"
    assert "died" in error["message"] and "restarted" in error["message"]
    assert "internal error" not in error["message"]
    assert response.headers.get("connection") != "close"


@pytest.mark.parametrize("name", FAMILIES)
def test_a_full_queue_answers_503_with_the_spec_message(
    name: str, family_of: Callable[..., Family]
) -> None:
    family = family_of(name, depth=1)
    family.occupy()
    with TestClient(family.app) as client:
        response = family.send(client)
    error = _error(response, 503)
    assert (error["type"], error["message"]) == ("server_busy", SPEC_BUSY)
    assert response.headers["retry-after"] == "1"


def test_a_full_text_queue_answers_the_same_message() -> None:
    class FullEngine(StandInEngine):
        def submit(self, request: GenerationRequest, sink: Any) -> None:
            raise QueueFullError("the prefill queue is full")

    async def open_one() -> None:
        EngineClient(FullEngine()).open(GenerationRequest(prompt_tokens=[1]))

    with pytest.raises(APIError) as caught:
        asyncio.run(open_one())
    answer = caught.value
    assert (answer.status, answer.type, answer.message) == (503, "server_busy", SPEC_BUSY)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_request_past_its_timeout_answers_504(
    name: str, family_of: Callable[..., Family]
) -> None:
    family = family_of(name, timeout=0.3)
    started = time.monotonic()
    with TestClient(family.app) as client:
        response = family.send(client)
    error = _error(response, 504)
    assert error["type"] == "timeout_error"
    assert "timed out after 0.3 s" in error["message"]
    assert time.monotonic() - started < 20  # not the gate's 30 s


# --------------------------------------------------------------------------- await_engine


def test_a_cancelled_handler_stops_the_running_job() -> None:
    """A client that goes away cancels its handler: the running job is told to stop."""
    worker = AudioWorker(loader=AudioModels, timeout=None).start()
    started, stopped = threading.Event(), threading.Event()
    job = until_stopped(started, stopped)

    async def give_up() -> None:
        task = asyncio.ensure_future(await_engine(lambda: worker.submit(job), None))
        assert await asyncio.to_thread(started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(give_up())
        assert stopped.wait(10), "the running job was not told to stop"
    finally:
        worker.stop()


def test_a_jobs_own_timeout_error_is_not_a_504() -> None:
    """Only the wait's own deadline answers 504; a TimeoutError of the job passes through."""
    failed: Future[None] = Future()
    failed.set_exception(TimeoutError("a socket timed out"))
    with pytest.raises(TimeoutError, match="socket"):
        asyncio.run(await_engine(lambda: failed, 5.0))


def test_an_unexpected_error_hides_its_traceback_from_the_client_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from fastapi import FastAPI

    from mlxcel.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise ValueError("secret /home/user/path")

    with (
        caplog.at_level("ERROR", logger="mlxcel.server.errors"),
        TestClient(app, raise_server_exceptions=False) as client,
    ):
        response = client.get("/boom")
    error = _error(response, 500)
    assert error["message"] == "internal error (ValueError)"
    assert "secret" not in response.text
    [record] = [r for r in caplog.records if r.name == "mlxcel.server.errors"]
    assert record.exc_info is not None and "GET /boom failed" in record.getMessage()
