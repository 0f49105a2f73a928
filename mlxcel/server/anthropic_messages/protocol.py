"""Anthropic Messages wire shapes: the request bodies (pydantic) and the answer's objects.

Request bodies allow unknown fields (`metadata`, `container`, `service_tier`, ...): they are
accepted and ignored. Content blocks stay plain dicts here; `convert` checks each one with a
message that names where it is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class InputMessage(BaseModel):
    """One turn: a string, or a list of content blocks."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what renders the prompt (no `max_tokens`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # llama-server accepts an empty conversation (the template renders without messages);
    # Anthropic's API refuses it.
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """The `usage` object of a message (also of a streamed `message_start` / `message_delta`).

    Anthropic's split of the `prompt_tokens` (what `/v1/messages/count_tokens` counts):
    `cache_read_input_tokens` is the part the engine took from its prompt cache,
    `input_tokens` the rest, and `cache_creation_input_tokens` is 0 (nothing is written on
    request), so the three add up to the prompt, as Anthropic and llama-server report them.
    """
    cached = min(max(cached_tokens, 0), prompt_tokens)
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def message_object(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    *,
    stop_reason: str | None,
    stop_sequence: str | None,
    prompt_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """A `message` object: the whole answer, or (empty, no stop) the stream's first event."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(prompt_tokens, output_tokens, cached_tokens),
    }


def text_block(text: str) -> dict[str, Any]:
    """A `text` content block."""
    return {"type": "text", "text": text}


def thinking_block(thinking: str) -> dict[str, Any]:
    """A `thinking` block; a local model signs nothing, so `signature` is empty."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(block_id: str, name: str, input: dict[str, Any]) -> dict[str, Any]:
    """A `tool_use` block: a call of the client's tool `name` with `input`."""
    return {"type": "tool_use", "id": block_id, "name": name, "input": input}
