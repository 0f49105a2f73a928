"""Routes: POST /v1/chat/completions (alias /chat/completions) and its input-token count."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from mlxcel.server.openai_chat.protocol import ChatCompletionRequest
from mlxcel.server.openai_chat.serving import ChatServing
from mlxcel.server.openai_common import parse_body
from mlxcel.server.state import ServerState, get_state

router = APIRouter()


@router.post("/v1/chat/completions")
@router.post("/chat/completions")
async def create_chat_completion(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """OpenAI chat completion, JSON or SSE (`stream: true`)."""
    body = await parse_body(raw, ChatCompletionRequest)
    return await ChatServing(state).create(body, raw)


@router.post("/v1/chat/completions/input_tokens")
@router.post("/chat/completions/input_tokens")
async def count_input_tokens(
    raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """The prompt tokens a chat request would use (llama-server's count route)."""
    body = await parse_body(raw, ChatCompletionRequest)
    return await ChatServing(state).input_tokens(body)
