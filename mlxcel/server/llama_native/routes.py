"""Routes of llama-server's native API (thin: parsing is pydantic, work is in serving).

Bodies are read as JSON whatever their Content-Type, as llama-server reads them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import Response

from mlxcel.server.chat.messages_body import ChatMessagesBody
from mlxcel.server.llama_native.protocol import (
    DetokenizeRequest,
    InfillRequest,
    NativeCompletionRequest,
    TokenizeRequest,
)
from mlxcel.server.llama_native.serving import NativeServing
from mlxcel.server.openai_common import parse_body
from mlxcel.server.state import ServerState, get_state

router = APIRouter()


@router.post("/completion")
@router.post("/completions")
async def completion(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """llama-server's native completion (JSON, or SSE with `stream`)."""
    body = await parse_body(raw, NativeCompletionRequest)
    return await NativeServing(state).completion(body, raw)


@router.post("/infill")
async def infill(raw: Request, state: ServerState = Depends(get_state)) -> Response:
    """Fill-in-the-middle; 501 `not_supported_error` without FIM tokens."""
    body = await parse_body(raw, InfillRequest)
    return await NativeServing(state).infill(body, raw)


@router.post("/tokenize")
async def tokenize(raw: Request, state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Token ids of `content` (with `with_pieces`: `{id, piece}` objects)."""
    body = await parse_body(raw, TokenizeRequest)
    return await NativeServing(state).tokenize(body)


@router.post("/detokenize")
async def detokenize(raw: Request, state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """Text of `tokens`; an out-of-vocabulary id is a 400 naming it and the vocabulary size."""
    body = await parse_body(raw, DetokenizeRequest)
    return await NativeServing(state).detokenize(body.tokens)


@router.post("/apply-template")
async def apply_template(raw: Request, state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """The chat-templated prompt of `messages`, not generated from."""
    body = await parse_body(raw, ChatMessagesBody)
    return await NativeServing(state).apply_template(body)
