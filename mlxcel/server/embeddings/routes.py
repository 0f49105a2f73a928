"""Routes: POST /v1/embeddings (OpenAI) and llama-server's own /embedding and /embeddings."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

from mlxcel.server.embeddings.protocol import (
    NativeEmbeddingRequest,
    OpenAIEmbeddingRequest,
    embedding_inputs,
)
from mlxcel.server.embeddings.services import get_embedding_service
from mlxcel.server.embeddings.serving import EmbeddingService, native_response, openai_response
from mlxcel.server.errors import bad_request
from mlxcel.server.json_body import JsonBodyRoute
from mlxcel.server.state import get_state

if TYPE_CHECKING:
    from mlxcel.engine.embeddings.embedder import EmbeddingOutput
    from mlxcel.server.embeddings.protocol import EmbeddingItem

router = APIRouter(route_class=JsonBodyRoute)


async def _embed(
    request: Request,
    service: EmbeddingService,
    inputs: Sequence[EmbeddingItem],
    **options: Any,
) -> EmbeddingOutput:
    """Run `inputs`, counting their tokens as processed prompt tokens for `/metrics`."""
    started = time.perf_counter()
    output = await service.embed(inputs, **options)
    seconds = time.perf_counter() - started
    get_state(request).counters.record_prompt(output.prompt_tokens, seconds)
    return output


@router.post("/v1/embeddings")
async def create_embeddings(
    body: OpenAIEmbeddingRequest,
    request: Request,
    service: EmbeddingService = Depends(get_embedding_service),
) -> JSONResponse:
    """OpenAI embeddings: one pooled vector per input, floats or base64 float32."""
    if service.pooling == "none":
        raise bad_request(
            "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
        )
    inputs = embedding_inputs(body.input, max_inputs=service.max_inputs)
    output = await _embed(
        request,
        service,
        inputs,
        normalize=body.embd_normalize,
        truncate=body.truncate,
        dimensions=body.dimensions,
    )
    payload = openai_response(
        output, model=body.model or service.model_name, encoding_format=body.encoding_format
    )
    return JSONResponse(payload)


async def _native(
    body: NativeEmbeddingRequest, request: Request, service: EmbeddingService
) -> JSONResponse:
    field = "content" if body.content is not None else "input"
    inputs = embedding_inputs(body.items(), field=field, max_inputs=service.max_inputs)
    output = await _embed(
        request, service, inputs, normalize=body.embd_normalize, truncate=body.truncate
    )
    payload: Any = native_response(output)
    return JSONResponse(payload)


@router.post("/embedding")
async def native_embedding(
    body: NativeEmbeddingRequest,
    request: Request,
    service: EmbeddingService = Depends(get_embedding_service),
) -> JSONResponse:
    """llama-server's /embedding: `[{index, embedding: [[...]]}]`."""
    return await _native(body, request, service)


@router.post("/embeddings")
async def native_embeddings(
    body: NativeEmbeddingRequest,
    request: Request,
    service: EmbeddingService = Depends(get_embedding_service),
) -> JSONResponse:
    """llama-server's /embeddings (same shape as /embedding; not the OpenAI one)."""
    return await _native(body, request, service)
