"""Route: POST /v1/completions (OpenAI legacy text completions)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from mlxcel.server.openai_common import parse_body
from mlxcel.server.openai_completions.protocol import CompletionRequest
from mlxcel.server.openai_completions.serving import CompletionServing
from mlxcel.server.state import ServerState, get_state

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """OpenAI text completion, JSON or SSE (`stream: true`)."""
    body = await parse_body(raw, CompletionRequest)
    return await CompletionServing(state).create(body, raw)
