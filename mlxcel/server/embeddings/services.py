"""The embedding and rerank services of a server: built from Settings, reached from requests.

`build_services(settings)` loads the models the settings ask for and starts one worker per
model; the runner stores the result on `ServerState.embeddings`. Which models:

- embeddings: `embedding_model` (a side model next to a chat model), else the main model
  when `--embedding` is set (an embedding-only server);
- rerank: `reranker_model`, else the main model when `--reranking` (or `--pooling rank`)
  is set. When both uses name the same encoder without a classification head, one model
  and one worker serve both (rerank by cosine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from mlxcel.server.errors import APIError, model_loading
from mlxcel.server.state import get_state

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.workers.embedding_worker import EmbeddingWorker
    from mlxcel.server.embeddings.serving import EmbeddingService
    from mlxcel.server.rerank.serving import RerankService

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32
DEFAULT_QUEUE_DEPTH = 64

# The 501 answers point at the flag that adds the model next to the running one (`--embedding`
# alone would make an embeddings-only server instead).
NO_EMBEDDINGS = (
    "This server has no embedding model. Start it with `--embedding-model MODEL` "
    "(`--embedding-model default`: the shipped all-MiniLM-L6-v2)"
)
NO_RERANK = (
    "This server has no reranking model. Start it with `--reranker-model MODEL` "
    "(`--reranker-model default`: the shipped all-MiniLM-L6-v2 ranking by cosine)"
)


@dataclass
class EmbeddingServices:
    """What the embedding and rerank routes use; None means the use is not enabled."""

    embeddings: EmbeddingService | None = None
    rerank: RerankService | None = None
    loading: bool = False
    workers: list[EmbeddingWorker] = field(default_factory=list)

    def stop(self) -> None:
        """Stop every worker thread."""
        for worker in self.workers:
            worker.stop()


def _services(request: Request) -> EmbeddingServices | None:
    return get_state(request).embeddings


def get_embedding_service(request: Request) -> EmbeddingService:
    """The embedding service, 503 while loading, 501 when the server has none."""
    services = _services(request)
    if services is not None and services.embeddings is not None:
        return services.embeddings
    if services is not None and services.loading:
        raise model_loading()
    raise APIError(501, NO_EMBEDDINGS, "not_supported_error")


def get_rerank_service(request: Request) -> RerankService:
    """The rerank service, 503 while loading, 501 when the server has none."""
    services = _services(request)
    if services is not None and services.rerank is not None:
        return services.rerank
    if services is not None and services.loading:
        raise model_loading()
    raise APIError(501, NO_RERANK, "not_supported_error")


def _setting(settings: Any, name: str, default: Any) -> Any:
    value = getattr(settings, name, None)
    return default if value is None else value


def wanted_models(settings: Settings) -> tuple[bool, str | None, bool, str | None]:
    """(embeddings on, embedding model ref, rerank on, reranker ref) from the settings."""
    emb_ref = _setting(settings, "embedding_model", None)
    rr_ref = _setting(settings, "reranker_model", None)
    want_emb = bool(emb_ref) or bool(settings.embedding)
    want_rr = bool(rr_ref) or bool(settings.reranking) or settings.pooling == "rank"
    return (
        want_emb,
        emb_ref or (settings.model if want_emb else None),
        want_rr,
        rr_ref or (settings.model if want_rr else None),
    )


def text_engine_wanted(settings: Settings) -> bool:
    """Whether the server also runs the text engine on the main model.

    No with `--embedding` (the main model is the embedding model: an embeddings-only
    server), and no when `--reranking` uses a main model that is an encoder.
    """
    from mlxcel.engine.embeddings.loader import is_encoder_model

    if settings.embedding and not _setting(settings, "embedding_model", None):
        return False
    _, _, want_rr, rr_ref = wanted_models(settings)
    return not (want_rr and rr_ref == settings.model and is_encoder_model(settings.model))


def build_services(settings: Settings) -> EmbeddingServices:
    """Load the embedding/rerank models the settings ask for and start their workers.

    Raises ModelLoadError when a model cannot be loaded. Returns empty services (every
    route answers 501) when neither use is enabled.
    """
    from mlxcel.engine.embeddings import load_embedder, load_reranker, reranker_for
    from mlxcel.engine.workers.embedding_worker import EmbeddingWorker
    from mlxcel.server.embeddings.serving import EmbeddingService
    from mlxcel.server.rerank.serving import RerankService

    want_emb, emb_ref, want_rr, rr_ref = wanted_models(settings)
    services = EmbeddingServices()
    if not want_emb and not want_rr:
        return services
    pooling = settings.pooling if settings.pooling not in (None, "rank") else None
    dtype = str(_setting(settings, "cpu_dtype", "auto"))
    cap = settings.ctx_size or None
    store = settings.model_store
    options: dict[str, Any] = {
        "batch_size": int(_setting(settings, "embedding_batch_size", DEFAULT_BATCH_SIZE)),
        "queue_depth": int(_setting(settings, "embedding_queue_depth", DEFAULT_QUEUE_DEPTH)),
    }
    timeout = float(_setting(settings, "embedding_timeout", 600.0))
    max_inputs = int(_setting(settings, "embedding_max_inputs", 2048))
    main_name = settings.alias

    embedder = None
    if want_emb:
        embedder = load_embedder(
            emb_ref, pooling=pooling, dtype=dtype, max_length=cap, store_dir=store
        )
    reranker = None
    if want_rr:
        if embedder is not None and rr_ref == emb_ref and _plain_encoder(embedder):
            reranker = reranker_for(embedder)
        else:
            reranker = load_reranker(rr_ref, dtype=dtype, max_length=cap, store_dir=store)

    shared = embedder is not None and getattr(reranker, "embedder", None) is embedder
    if embedder is not None:
        worker = EmbeddingWorker(
            embedder=embedder, reranker=reranker if shared else None, **options
        ).start()
        services.workers.append(worker)
        name = main_name if (main_name and emb_ref == settings.model) else embedder.name
        services.embeddings = EmbeddingService(
            worker,
            model_name=name,
            normalize=settings.embd_normalize,
            max_inputs=max_inputs,
            timeout=timeout,
        )
    if reranker is not None:
        if shared:
            rr_worker = services.workers[0]
        else:
            rr_worker = EmbeddingWorker(reranker=reranker, **options).start()
            services.workers.append(rr_worker)
        name = main_name if (main_name and rr_ref == settings.model) else reranker.name
        services.rerank = RerankService(
            rr_worker, model_name=name, max_inputs=max_inputs, timeout=timeout
        )
    return services


def _plain_encoder(embedder: Any) -> bool:
    """An encoder without a classification head (so it reranks by cosine)."""
    model = getattr(embedder, "model", None)
    config = getattr(model, "config", None)
    return embedder.kind == "encoder" and getattr(config, "num_labels", 0) == 0
