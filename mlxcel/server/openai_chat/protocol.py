"""Request body of the chat completions routes (pydantic; unknown fields allowed)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxcel.server.sampling_fields import MAX_TOP_LOGPROBS, SamplingFields

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    """One message; `content` is a string, a list of content parts, or null."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` has a meaning here."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # llama-server / vLLM rendering switches: no generation prompt, or continue the final
    # assistant message (a trailing assistant message is continued by default).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # False: a trailing assistant message is history and the model starts a new turn
    # (the Responses and Messages routes); llama-server's default continues it.
    prefill_assistant: bool = True

    def token_limit(self) -> int | None:
        """`max_completion_tokens`, else `max_tokens` (None: the server default)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """Alternatives per token for the engine (None: logprobs off)."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
