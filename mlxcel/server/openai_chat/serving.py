"""Chat completions: a request body becomes a `ChatRequest`, which the chat core admits as
one engine job per choice (`n`); their events become the answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.chat.core import ChatCore
from mlxcel.server.errors import model_loading
from mlxcel.server.llama_native.encoder import VerboseReport
from mlxcel.server.openai_chat.encoder import ChatEncoder
from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
from mlxcel.server.openai_common import new_id, now, reported_model
from mlxcel.server.sampling_fields import MAX_CHOICES

if TYPE_CHECKING:
    from mlxcel.server.state import ServerState


class ChatServing:
    """Runs chat completion requests against the server's engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.core = ChatCore(state)

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """Answer one request: JSON, or an SSE stream once admission succeeded."""
        verbose = body.wants_verbose(self.state.settings.verbose)
        job = await self.core.start(
            body.chat_request(), raw, max_choices=MAX_CHOICES, stream_reports=body.stream
        )
        meta = {
            "id": new_id("chatcmpl-"),
            "created": now(),
            "model": reported_model(self.state, body.model),
        }
        assert self.state.tokenizer is not None
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        report = (
            VerboseReport(self.state, job.job.request, str(meta["model"]), stream=body.stream)
            if verbose
            else None
        )
        encoder = ChatEncoder(
            job, self.state.tokenizer, meta, include_usage=include_usage, verbose=report
        )
        return await job.job.respond(raw, encoder, stream=body.stream)

    async def prompt_text(self, body: ChatCompletionRequest) -> str:
        """The templated prompt as text (POST /apply-template); 400 on errors."""
        return await self.core.prompt_text(body.chat_request())

    async def input_tokens(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """POST /v1/chat/completions/input_tokens: how many prompt tokens `body` would use."""
        if self.state.tokenizer is None:
            raise model_loading()
        prompt = await self.core.render(body.chat_request())
        return {"input_tokens": len(prompt.tokens), "object": "response.input_tokens"}
