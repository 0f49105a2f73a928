"""Routes: POST /v1/rerank, /v1/reranking, /rerank, /reranking."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.responses import JSONResponse

from mlxcel.server.embeddings.services import get_rerank_service
from mlxcel.server.json_body import JsonBodyRoute
from mlxcel.server.rerank.protocol import RerankRequest
from mlxcel.server.rerank.serving import RerankService, jina_response, tei_response

router = APIRouter(route_class=JsonBodyRoute)


@router.post("/v1/rerank")
@router.post("/v1/reranking")
@router.post("/rerank")
@router.post("/reranking")
async def rerank(
    body: RerankRequest, service: RerankService = Depends(get_rerank_service)
) -> JSONResponse:
    """Rank documents against a query: Jina/Cohere shape for `documents`, TEI for `texts`."""
    docs = body.document_texts(service.max_inputs)
    output = await service.rerank(
        body.query, docs, truncate=body.truncate, instruction=body.instruction
    )
    payload: Any
    if body.tei:
        payload = tei_response(
            output,
            docs,
            top_n=body.top_n,
            raw_scores=body.raw_scores,
            return_text=body.return_text,
        )
    else:
        payload = jina_response(
            output,
            docs,
            model=body.model or service.model_name,
            top_n=body.top_n,
            return_documents=body.return_documents,
        )
    return JSONResponse(payload)
