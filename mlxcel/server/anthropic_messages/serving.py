"""Messages requests: translated into a chat request and run through the chat path.

A request is translated (`convert`) and admitted by `ChatCore.start`, so every 400 and
503 comes before any byte is sent; `MessagesEncoder` shapes the answer. A prompt longer
than the context reads as Anthropic's ("prompt is too long: N tokens > M maximum"), the
message the SDKs, langchain-anthropic and litellm recognize as a context overflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.anthropic_messages.convert import to_chat_request
from mlxcel.server.anthropic_messages.encoder import MessagesEncoder
from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
from mlxcel.server.chat.core import ChatCore
from mlxcel.server.errors import APIError, bad_request, server_busy
from mlxcel.server.openai_common import new_id, reported_model

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState


def prompt_too_long(error: APIError) -> APIError | None:
    """Anthropic's 400 for a `context_length_exceeded` error (None for any other): the
    maximum is the most prompt tokens a slot takes (one is left for the answer)."""
    n_prompt, n_ctx = error.extra.get("n_prompt_tokens"), error.extra.get("n_ctx")
    if error.code != "context_length_exceeded" or n_prompt is None or n_ctx is None:
        return None
    return bad_request(f"prompt is too long: {n_prompt} tokens > {n_ctx - 1} maximum")


class MessagesServing:
    """Runs Messages requests through the chat path."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.core = ChatCore(state)

    @property
    def takes_images(self) -> bool:
        """Whether the loaded model takes image inputs (a vision model that reads images)."""
        media = self.state.media
        return media is not None and "image" in media.modalities

    async def create(self, body: MessagesRequest, raw: Request) -> Response:
        """Answer one request: a message object, or its SSE events once admitted."""
        chat = to_chat_request(body, images=self.takes_images)
        try:
            job = await self.core.start(chat, raw, stream_reports=body.stream)
        except APIError as exc:
            overflow = prompt_too_long(exc)
            if overflow is None:
                raise
            raise overflow from None
        message_id = new_id("msg_")
        model = reported_model(self.state, body.model)
        encoder = MessagesEncoder(job, message_id, model, body.stop_sequences or ())
        return await job.job.respond(raw, encoder, stream=body.stream)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """POST /v1/messages/count_tokens: the tokens of the prompt `body` renders to."""
        if self.state.tokenizer is None:
            raise server_busy("loading model")
        prompt = await self.core.render(to_chat_request(body, images=self.takes_images))
        return {"input_tokens": len(prompt.tokens)}
