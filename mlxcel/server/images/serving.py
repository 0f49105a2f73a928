"""Image requests -> worker jobs, and pictures -> OpenAI's images response."""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.server.bridge import await_engine
from mlxcel.server.errors import APIError, bad_request, not_implemented
from mlxcel.server.images.protocol import (
    FILE_FIELDS,
    ImageData,
    ImageEditRequest,
    ImageInput,
    ImagesResponse,
)
from mlxcel.server.json_body import read_json_body
from mlxcel.server.state import get_state

if TYPE_CHECKING:
    from mlxcel.engine.image import GeneratedPicture, ImageRequest
    from mlxcel.engine.workers.image_worker import ImageWorker

MULTIPART_MESSAGE = (
    "this server takes image requests as JSON only (Content-Type: application/json): send the "
    'input pictures as data URIs, {"prompt": "...", "images": [{"image_url": '
    '"data:image/png;base64,..."}]}; multipart/form-data uploads are not accepted'
)
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?:;[^,]*)?;base64,(?P<data>.*)$", re.S)


def image_worker(request: Request) -> ImageWorker | None:
    """The server's image worker (`ServerState.image`; None: no `--image-model`)."""
    return get_state(request).image


def require_worker(request: Request) -> ImageWorker:
    """The image worker; 501 naming --image-model when the server has none."""
    worker = image_worker(request)
    if worker is None:
        raise not_implemented(
            "this server has no image model; start it with --image-model PATH "
            "(or MLXCEL_IMAGE_MODEL) to serve /v1/images/generations and /v1/images/edits"
        )
    return worker


async def read_json(request: Request, model: type[BaseModel]) -> Any:
    """The body as `model`: 415 for multipart, 400 for bad JSON, bad fields or file fields."""
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/") or content_type.startswith(
        "application/x-www-form-urlencoded"
    ):
        raise APIError(
            415, MULTIPART_MESSAGE, "invalid_request_error", code="unsupported_media_type"
        )
    body = await read_json_body(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in FILE_FIELDS:
        if name in body:
            raise bad_request(
                f"{name} is not supported: the server does not write files for the client; "
                "the images come back as b64_json"
            )
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise bad_request(f"{where}: {first.get('msg', 'invalid value')}") from None
    check_formats(parsed)
    return parsed


def check_formats(body: Any) -> None:
    """`response_format` b64_json only, `output_format` png only, no transparent background."""
    if body.response_format not in (None, "b64_json"):
        raise bad_request(
            f"response_format {body.response_format!r} is not supported: only b64_json "
            "(the server does not host files to link to)"
        )
    if body.output_format not in (None, "png"):
        raise bad_request(f"output_format {body.output_format!r} is not supported: only png")
    if body.background not in (None, "auto", "opaque"):
        raise bad_request(f"background {body.background!r} is not supported: auto or opaque")


def decode_image(text: str, label: str) -> bytes:
    """A data URI or bare base64 string as bytes (400 otherwise: no URLs, no file paths)."""
    value = text.strip()
    match = _DATA_URI.match(value)
    if match is not None:
        value = match.group("data")
    elif value.startswith(("http://", "https://", "file:", "/")):
        raise bad_request(
            f"{label}: give the picture as a data URI or base64 string; the server does not "
            "fetch URLs or read files for the client"
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{label} is not valid base64 (or a data:image/...;base64 URI)") from None
    if not data:
        raise bad_request(f"{label} is empty")
    return data


def edit_inputs(body: ImageEditRequest) -> list[bytes]:
    """The input pictures of an edit request, decoded and checked."""
    from mlxcel.engine.image import check_input_image

    if body.mask is not None:
        raise bad_request("mask is not supported: the served families edit whole pictures")
    texts: list[tuple[str, str]] = []
    if isinstance(body.image, str):
        texts.append(("image", body.image))
    elif isinstance(body.image, list):
        texts.extend((f"image[{i}]", item) for i, item in enumerate(body.image))
    for i, item in enumerate(body.images or []):
        if isinstance(item, ImageInput):
            if item.file_id is not None:
                raise bad_request(f"images[{i}].file_id is not supported: send image_url")
            if not item.image_url:
                raise bad_request(f"images[{i}] needs an image_url (a data URI)")
            texts.append((f"images[{i}]", item.image_url))
        else:
            texts.append((f"images[{i}]", item))
    if not texts:
        raise bad_request("an edit needs an input picture: image or images")
    pictures = []
    for label, text in texts:
        data = decode_image(text, label)
        try:
            check_input_image(data, label)
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None
        pictures.append(data)
    return pictures


def build_job(body: Any, images: list[bytes] | None = None) -> ImageRequest:
    """The engine job for a generation (no `images`) or an edit request."""
    from mlxcel.engine.image import ImageRequest, parse_size

    try:
        width, height = parse_size(body.size)
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from None
    return ImageRequest(
        prompt=body.prompt,
        width=width,
        height=height,
        n=body.n,
        seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
        steps=body.steps,
        guidance=body.guidance,
        negative_prompt=body.negative_prompt,
        images=images or [],
        strength=getattr(body, "strength", None),
    )


async def run_job(worker: ImageWorker, job: ImageRequest) -> list[GeneratedPicture]:
    """Run `job` on the worker within its timeout; engine errors become HTTP ones."""
    return await await_engine(lambda: worker.submit(job), worker.timeout)


def render(job: ImageRequest, pictures: list[GeneratedPicture]) -> dict[str, Any]:
    """The success body: created, data[], output_format, size."""
    response = ImagesResponse(
        created=int(time.time()),
        data=[
            ImageData(
                b64_json=base64.b64encode(p.png).decode("ascii"),
                width=p.width,
                height=p.height,
                seed=p.seed,
                revised_prompt=job.prompt,
            )
            for p in pictures
        ],
        size=f"{job.width}x{job.height}",
    )
    return response.model_dump()
