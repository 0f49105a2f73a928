"""Routes of OpenAI's image API, each also without the /v1 prefix:

- POST /v1/images/generations: JSON `prompt`, `n`, `size`, `seed`, `steps`, ...;
- POST /v1/images/edits: the same plus `image`/`images` (data URIs) and `strength`.

Without `--image-model` both answer 501 naming the flag; multipart bodies get 415.
`image_only_router()` answers the chat and completion routes with 501 on a server that runs
an image model and no text model.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from mlxcel.server.audio.routes import CHAT_AND_COMPLETION_ROUTES
from mlxcel.server.errors import APIError
from mlxcel.server.images.protocol import ImageEditRequest, ImageGenerationRequest
from mlxcel.server.images.serving import (
    build_job,
    edit_inputs,
    read_json,
    render,
    require_worker,
    run_job,
)
from mlxcel.server.media.offload import off_loop

router = APIRouter()


@router.post("/v1/images/generations")
@router.post("/images/generations")
async def create_image(request: Request) -> JSONResponse:
    """Text to image."""
    worker = require_worker(request)
    body = await read_json(request, ImageGenerationRequest)
    job = build_job(body)
    return JSONResponse(render(job, await run_job(worker, job)))


@router.post("/v1/images/edits")
@router.post("/images/edits")
async def edit_image(request: Request) -> JSONResponse:
    """Image(s) + prompt to image: img2img, or reference editing on an edit family."""
    worker = require_worker(request)
    body = await read_json(request, ImageEditRequest)
    job = build_job(body, await off_loop(edit_inputs, body))  # base64 and PIL checks
    return JSONResponse(render(job, await run_job(worker, job)))


IMAGE_ROUTES = ("/v1/images/generations", "/v1/images/edits")


def image_only_router() -> APIRouter:
    """Chat and completion routes answering 501 on a server that runs an image model only."""
    listing = ", ".join(f"POST {route}" for route in IMAGE_ROUTES)
    message = f"this server runs an image model only; it serves {listing}"
    stub = APIRouter()

    async def unavailable() -> JSONResponse:
        raise APIError(501, message, "not_implemented")

    for path in CHAT_AND_COMPLETION_ROUTES:
        stub.add_api_route(path, unavailable, methods=["POST"], include_in_schema=False)
    return stub
