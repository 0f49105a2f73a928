"""Wire models of OpenAI's image API as mlxcel serves it (JSON bodies only)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FILE_FIELDS = ("url", "path", "output_path", "output_dir")
"""Fields asking the server to write or fetch files for the client: refused with 400."""


class ImageInput(BaseModel):
    """An input picture in OpenAI's JSON edit form: `{"image_url": "data:image/png;base64,..."}`."""

    model_config = ConfigDict(extra="allow")

    image_url: str | None = None
    file_id: str | None = None


class _ImageFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1, le=10)
    size: str | None = "auto"
    response_format: str | None = "b64_json"
    output_format: str | None = "png"
    output_compression: int | None = Field(None, ge=0, le=100)
    background: str | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    user: str | None = None
    # mlxcel's own fields
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    steps: int | None = Field(None, ge=1, le=200)
    guidance: float | None = Field(None, ge=0, le=50)
    negative_prompt: str | None = None


class ImageGenerationRequest(_ImageFields):
    """POST /v1/images/generations."""


class ImageEditRequest(_ImageFields):
    """POST /v1/images/edits: `image` (one or several data URIs or base64 strings) or `images`
    (OpenAI's `[{"image_url": ...}]` form); `strength` (0-1) for img2img."""

    image: str | list[str] | None = None
    images: list[ImageInput | str] | None = None
    mask: Any = None
    strength: float | None = Field(None, gt=0, lt=1)
    input_fidelity: str | None = None


class ImageData(BaseModel):
    b64_json: str
    mime_type: Literal["image/png"] = "image/png"
    width: int
    height: int
    seed: int
    revised_prompt: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str
