"""What every route handler can reach: settings, the engine and workers, model facts.

`ServerState` is the server's services object: `mlxcel.server.boot` builds what it holds
from the settings (the text engine and its client, the side models' workers), every field
has its type, and the routes ask it (and the engine's protocol, `state.engine`) for what
they need instead of reaching into an engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from mlxcel.server.llama_native.fim import FimTokens
from mlxcel.server.media import MediaPolicy

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.distributed.group import Ranks
    from mlxcel.engine.loading.model import ModelInfo
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.request import GenerationEvent
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.engine.workers.audio import AudioWorker
    from mlxcel.engine.workers.image_worker import ImageWorker
    from mlxcel.server.bridge import EngineClient
    from mlxcel.server.embeddings.services import EmbeddingServices
    from mlxcel.server.engine_protocol import GenerationEngine
    from mlxcel.server.media.parts import ModelMedia


@dataclass
class RequestCounters:
    """What `/metrics` sums over the generation requests that finished normally, on every
    route, streamed or not: the same numbers their `usage` and `timings` report."""

    requests_total: int = 0
    prompt_tokens_total: int = 0  # usage.prompt_tokens
    completion_tokens_total: int = 0  # usage.completion_tokens
    generation_seconds_total: float = 0.0  # admission to the final event
    prompt_tokens_processed: int = 0  # timings.prompt_n (cached tokens excluded)
    prompt_tokens_cached: int = 0  # timings.cache_n
    prompt_seconds_total: float = 0.0  # timings.prompt_ms
    tokens_predicted: int = 0  # timings.predicted_n
    predicted_seconds_total: float = 0.0  # timings.predicted_ms
    draft_tokens: int = 0  # timings.draft_n
    draft_tokens_accepted: int = 0  # timings.draft_n_accepted
    draft_rounds: int = 0  # timings.draft_rounds

    def record(self, final: GenerationEvent, seconds: float) -> None:
        """Count one request that finished normally with the final event `final`."""
        self.requests_total += 1
        self.prompt_tokens_total += final.prompt_tokens
        self.completion_tokens_total += final.completion_tokens
        self.generation_seconds_total += seconds
        timings = final.timings
        if timings is None:  # an engine without timings: usage is all there is
            self.prompt_tokens_processed += final.prompt_tokens
            self.tokens_predicted += final.completion_tokens
            return
        self.prompt_tokens_processed += timings.prompt_n
        self.prompt_tokens_cached += timings.cache_n
        self.prompt_seconds_total += timings.prompt_ms / 1000
        self.tokens_predicted += timings.predicted_n
        self.predicted_seconds_total += timings.predicted_ms / 1000
        self.draft_tokens += timings.draft_n
        self.draft_tokens_accepted += timings.draft_n_accepted
        self.draft_rounds += timings.draft_rounds

    def record_prompt(self, tokens: int, seconds: float) -> None:
        """Count a prompt evaluated without generation (an embedding request)."""
        self.prompt_tokens_processed += tokens
        self.prompt_seconds_total += seconds


@dataclass
class ServerState:
    """The server's services, stored on `app.state.mlxcel`.

    `client`, `tokenizer` and `model_info` are None while the model is loading (and on a
    server without a chat model); a side model's worker is None when it is not asked for.
    """

    settings: Settings
    client: EngineClient | None = None  # set last: the text model is ready from then on
    tokenizer: Tokenizer | None = None
    model_info: ModelInfo | None = None
    prompt_cache: PromptCache | None = None  # None: `--cache-ram 0`, `--no-cache-prompt`
    counters: RequestCounters = field(default_factory=RequestCounters)
    started: float = field(default_factory=time.time)
    embeddings: EmbeddingServices | None = None
    audio: AudioWorker | None = None
    image: ImageWorker | None = None
    text_engine: bool = True  # False on servers without a chat model (side models only)
    media: ModelMedia | None = None  # what a vision model takes; None: a text model
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)  # vision: set at start
    fim: FimTokens = field(default_factory=FimTokens)  # the tokenizer's FIM token ids
    ranks: Ranks | None = None  # the group of ranks this server is rank 0 of (None: alone)

    @property
    def engine(self) -> GenerationEngine | None:
        """The generation engine; None while loading or without a chat model."""
        return self.client.engine if self.client is not None else None

    @property
    def loading(self) -> bool:
        if self.audio is not None and not self.audio.ready:
            return True
        if not self.text_engine:
            return self.embeddings is not None and bool(self.embeddings.loading)
        return self.client is None

    @property
    def model_name(self) -> str:
        """The name the API reports: the first `--alias` (sorted, as llama-server), else
        the chat model's name, else (no chat model) the first side model's."""
        aliases = self.settings.alias_names()
        if aliases:
            return aliases[0]
        if self.model_info is not None:
            return self.model_info.name
        side = self.side_model_names
        return side[0] if side else "unknown"

    @property
    def side_model_names(self) -> list[str]:
        """The loaded embedding, rerank, speech-to-text, text-to-speech and image models'
        names, in that order, each once."""
        names: list[str] = []
        services = self.embeddings
        if services is not None:
            names += [s.model_name for s in (services.embeddings, services.rerank) if s]
        if self.audio is not None:
            names += [m.name for m in (self.audio.models.stt, self.audio.models.tts) if m]
        if self.image is not None:
            names.append(self.image.model.name)
        return list(dict.fromkeys(names))


def get_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    state: ServerState = request.app.state.mlxcel
    return state
