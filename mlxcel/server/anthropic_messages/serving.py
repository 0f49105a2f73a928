"""Messages requests: translated into a chat request and run through the chat path.

A request is translated (`convert`) and admitted by `ChatServing.start`, so every 400 and
503 comes before any byte is sent; `MessagesEncoder` shapes the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.anthropic_messages.convert import to_chat_request
from mlxcel.server.anthropic_messages.encoder import MessagesEncoder
from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
from mlxcel.server.errors import server_busy
from mlxcel.server.openai_chat.serving import ChatServing
from mlxcel.server.openai_common import new_id, reported_model

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState


class MessagesServing:
    """Runs Messages requests through the chat path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.chat = ChatServing(state)

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        """Answer one request: a message object, or its SSE events once admitted."""
        job = await self.chat.start(to_chat_request(body), raw)
        message_id = new_id("msg_")
        model = reported_model(self.state, body.model)
        encoder = MessagesEncoder(job, message_id, model, body.stop_sequences or ())
        return await job.job.respond(raw, encoder, stream=body.stream)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """POST /v1/messages/count_tokens: the tokens of the prompt `body` renders to."""
        if self.state.tokenizer is None:
            raise server_busy("loading model")
        tokens = await self.chat.prompt_tokens(to_chat_request(body))
        return {"input_tokens": len(tokens)}
