"""What every route handler can reach: settings, the engine client, model facts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.loading.model import ModelInfo
    from mlxcel.engine.text.request import GenerationEvent
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.bridge import EngineClient


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
    """Shared server state, stored on `app.state.mlxcel`.

    `client`, `tokenizer` and `model_info` are None while the model is loading.
    """

    settings: Settings
    client: EngineClient | None = None
    tokenizer: Tokenizer | None = None
    model_info: ModelInfo | None = None
    prompt_cache: Any = None  # mlxcel.engine.text.prompt_cache.PromptCache | None
    counters: RequestCounters = field(default_factory=RequestCounters)
    started: float = field(default_factory=time.time)
    embeddings: Any = None  # mlxcel.server.embeddings.services.EmbeddingServices | None
    audio: Any = None  # mlxcel.engine.workers.audio.AudioWorker | None
    text_engine: bool = True  # False on embeddings-only and audio-only servers
    media: Any = None  # mlxcel.server.media.parts.ModelMedia when a vision model is loaded
    media_policy: Any = None  # mlxcel.server.media.MediaPolicy, read once at start

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
        image = getattr(self, "image", None)  # set by the runner with `--image-model`
        if image is not None:
            names.append(image.model.name)
        return list(dict.fromkeys(names))


def get_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    state: ServerState = request.app.state.mlxcel
    return state
