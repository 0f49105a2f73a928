"""What every route handler can reach: settings, the engine client, model facts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.loading.model import ModelInfo
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.bridge import EngineClient


@dataclass
class RequestCounters:
    """Counters kept by the HTTP layer, counted as the spec's `/metrics` says."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    generation_seconds_total: float = 0.0


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
        the model's name."""
        aliases = self.settings.alias_names()
        if aliases:
            return aliases[0]
        return self.model_info.name if self.model_info is not None else "unknown"


def get_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    state: ServerState = request.app.state.mlxcel
    return state
