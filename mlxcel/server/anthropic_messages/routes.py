"""Routes: POST /v1/messages and /v1/messages/count_tokens (aliases without /v1).

The `anthropic-version` and `anthropic-beta` headers are accepted and never required.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from mlxcel.server.anthropic_messages.protocol import CountTokensRequest, MessagesRequest
from mlxcel.server.anthropic_messages.serving import MessagesServing
from mlxcel.server.openai_common import parse_body
from mlxcel.server.state import ServerState, get_state

router = APIRouter()


@router.post("/v1/messages")
@router.post("/messages")
async def create_message(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """Anthropic Messages: a message object, or its SSE events (`stream: true`)."""
    body = await parse_body(raw, MessagesRequest)
    return await MessagesServing(state).create(body, raw)


@router.post("/v1/messages/count_tokens")
@router.post("/messages/count_tokens")
async def count_message_tokens(
    raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, int]:
    """`{"input_tokens": N}`: the prompt tokens a Messages request would use."""
    body = await parse_body(raw, CountTokensRequest)
    return await MessagesServing(state).count_tokens(body)
