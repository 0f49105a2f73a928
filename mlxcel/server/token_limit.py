"""llama-server's `n_predict` on every generation body, over the OpenAI token limits."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TokenLimitFields(BaseModel):
    """The `n_predict` field: llama-server reads it on every route before `max_tokens`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    n_predict: int | None = Field(None, ge=-2)

    def llama_limit(self, openai_limit: int | None) -> int | None:
        """`n_predict`, else the route's OpenAI limit; -1 and -2 (until the context fills)
        read as None (the server's `--predict`)."""
        value = self.n_predict if self.n_predict is not None else openai_limit
        if value is None or value < 0:
            return None
        return value
