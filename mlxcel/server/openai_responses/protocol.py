"""Request bodies of POST /v1/responses (and /input_tokens) and of the Conversations routes
(unknown fields allowed).

Fields the server does not act on (`user`, `include`, `prompt_cache_key`, ...) are accepted
and ignored; sampling extras the chat route understands (`top_k`, `seed`, `stop`,
`thinking_budget_tokens`, `chat_template_kwargs`, ...) are passed on to it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "stream",
        "stream_options",
        "store",
        "previous_response_id",
        "conversation",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "max_tool_calls",
        "temperature",
        "top_p",
        "top_logprobs",
        "metadata",
        "truncation",
        "background",
        "reasoning",
        "context_management",
        "include",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "prompt",
        "personality",
    }
)
"""Responses API fields: never forwarded to the chat request as they are."""


class ResponsesRequest(BaseModel):
    """POST /v1/responses (and the same body on /v1/responses/input_tokens)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None

    def passthrough(self) -> dict[str, Any]:
        """Extra fields for the chat request (sampling knobs, template switches...)."""
        return {
            key: value
            for key, value in (self.model_extra or {}).items()
            if key not in RESPONSES_FIELDS
        }


class ConversationCreate(BaseModel):
    """POST /v1/conversations: the first items and the metadata (both optional)."""

    model_config = ConfigDict(extra="allow")

    items: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None


class ConversationUpdate(BaseModel):
    """POST /v1/conversations/{id}: new metadata."""

    model_config = ConfigDict(extra="allow")

    metadata: dict[str, Any]


class ConversationItemsCreate(BaseModel):
    """POST /v1/conversations/{id}/items: items to append."""

    model_config = ConfigDict(extra="allow")

    items: list[dict[str, Any]]
