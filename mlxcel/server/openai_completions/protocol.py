"""Request body of POST /v1/completions (pydantic; unknown fields allowed)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictInt

from mlxcel.server.openai_common import StreamOptions
from mlxcel.server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields
from mlxcel.server.token_limit import TokenLimitFields

Prompt = str | list[str] | list[StrictInt] | list[list[StrictInt]]
"""Text or token ids; an id is a JSON integer (`true` or `"5"` is no token id)."""


class CompletionRequest(SamplingFields, TokenLimitFields):
    """POST /v1/completions: one prompt (text or token ids), one choice."""

    model: str | None = None
    prompt: Prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        """llama-server's `n_predict`, else `max_tokens` (None: the server default)."""
        return self.llama_limit(self.max_tokens)
