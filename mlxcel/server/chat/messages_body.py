"""`ChatMessagesBody`: the chat body OpenAI's chat completions and llama-server share
(messages, tools, tool_choice, response_format and the chat options), as
`POST /v1/chat/completions` and `POST /apply-template` both read it (pydantic; unknown
fields allowed)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxcel.server.chat.request import ChatOptions, ChatRequest, ChatTurn

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    """One message; `content` is a string, a list of content parts, or null."""

    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def turn(self, index: int) -> ChatTurn:
        """The message as the chat core's turn `messages[index]`."""
        message: dict[str, Any] = dict(self.model_extra or {})
        message["role"] = self.role
        message["content"] = self.content
        for key in ("name", "tool_call_id", "tool_calls"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return ChatTurn(message, f"messages[{index}]")


class ChatMessagesBody(ChatOptions):
    """A body of `messages` with its tools and options (no transport fields)."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def chat_request(self) -> ChatRequest:
        """The body as the chat core runs it: a trailing assistant message is continued
        (llama-server's prefill)."""
        parallel = (self.model_extra or {}).get("parallel_tool_calls")
        return ChatRequest.build(
            [message.turn(i) for i, message in enumerate(self.messages)],
            self,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=parallel if isinstance(parallel, bool) else None,
            response_format=self.response_format,
            continue_assistant=True,
        )
