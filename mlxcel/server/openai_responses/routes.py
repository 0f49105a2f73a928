"""Routes: /v1/responses (create, retrieve, delete, cancel, input_tokens, input_items), also
without /v1, and the Conversations routes (`conversation_routes.py`).

POST /v1/responses/compact summarizes a history (`compaction.py` holds the logic).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from mlxcel.server.json_body import read_json_body
from mlxcel.server.openai_common import parse_body
from mlxcel.server.openai_responses.conversation_routes import router as conversations_router
from mlxcel.server.openai_responses.pagination import PageQuery
from mlxcel.server.openai_responses.protocol import ResponsesRequest
from mlxcel.server.openai_responses.serving import ResponsesServing
from mlxcel.server.openai_responses.store import stores_for
from mlxcel.server.state import ServerState, get_state

router = APIRouter()
router.include_router(conversations_router)


def serving_for(raw: Request, state: ServerState) -> ResponsesServing:
    """The Responses serving layer of the app handling `raw` (its stores live on the app)."""
    return ResponsesServing(state, stores_for(raw.app, state.settings))


@router.post("/v1/responses")
@router.post("/responses")
async def create_response(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """OpenAI Responses create, JSON or typed SSE (`stream: true`)."""
    body = await parse_body(raw, ResponsesRequest)
    return await serving_for(raw, state).create(body, raw)


@router.post("/v1/responses/compact")
@router.post("/responses/compact")
async def compact_history(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """Summarize older turns of `input` into one compaction item (nothing is stored)."""
    payload = await read_json_body(raw)
    return await serving_for(raw, state).compact(payload, raw)


@router.post("/v1/responses/input_tokens")
@router.post("/responses/input_tokens")
async def count_input_tokens(
    raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """The prompt tokens a create request with this body would use."""
    body = await parse_body(raw, ResponsesRequest)
    return await serving_for(raw, state).input_tokens(body)


@router.get("/v1/responses/{response_id}")
@router.get("/responses/{response_id}")
async def retrieve_response(
    response_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """A stored response."""
    return serving_for(raw, state).retrieve(response_id)


@router.get("/v1/responses/{response_id}/input_items")
@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    raw: Request,
    state: ServerState = Depends(get_state),
    page: PageQuery = Depends(),
) -> dict[str, Any]:
    """One page of a stored response's input items (`limit`, `order`, `after`)."""
    return serving_for(raw, state).input_items(response_id, page)


@router.delete("/v1/responses/{response_id}")
@router.delete("/responses/{response_id}")
async def delete_response(
    response_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Delete a stored response."""
    return serving_for(raw, state).delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
@router.post("/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any]:
    """Mark a stored response `cancelled`, stopping it first if it is still generating."""
    return await serving_for(raw, state).cancel(response_id)
