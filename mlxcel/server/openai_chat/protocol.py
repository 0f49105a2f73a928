"""Request body of the chat completions routes (pydantic; unknown fields allowed)."""

from __future__ import annotations

from mlxcel.server.chat.messages_body import ChatMessagesBody
from mlxcel.server.openai_common import StreamOptions


class ChatCompletionRequest(ChatMessagesBody):
    """POST /v1/chat/completions: the shared chat body and how to deliver the answer."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
