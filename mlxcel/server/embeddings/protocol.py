"""Request bodies of the embedding routes, and the input normalization they share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxcel.server.errors import bad_request

EmbeddingItem = str | list[int]


class OpenAIEmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI), plus llama-server's `embd_normalize` and a `truncate` flag."""

    model_config = ConfigDict(extra="allow")

    input: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    embd_normalize: int | None = Field(None, ge=-1)
    truncate: bool = True


class NativeEmbeddingRequest(BaseModel):
    """POST /embedding and /embeddings (llama-server): `content` or `input`."""

    model_config = ConfigDict(extra="allow")

    content: Any = None
    input: Any = None
    embd_normalize: int | None = Field(None, ge=-1)
    truncate: bool = True

    def items(self) -> Any:
        """`content`, else `input`."""
        return self.content if self.content is not None else self.input


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def embedding_inputs(value: Any, *, field: str = "input", max_inputs: int) -> list[EmbeddingItem]:
    """A request's input as a list of texts and token-id lists (400 when malformed).

    Accepts a string, a list of token ids (one input), or a list whose items are strings or
    token-id lists. Empty input, empty strings and more than `max_inputs` items are refused.
    """
    if value is None:
        raise bad_request(f"'{field}' is required")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_token_list(value) and value:
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(f"'{field}' must be a string, a list of strings or token ids")
    if not items:
        raise bad_request(f"'{field}' is empty")
    if len(items) > max_inputs:
        raise bad_request(f"'{field}' has {len(items)} items; at most {max_inputs} are allowed")
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'{field}[{i}]' is an empty string")
        elif _is_token_list(item):
            if not item:
                raise bad_request(f"'{field}[{i}]' is an empty token list")
        else:
            raise bad_request(f"'{field}[{i}]' must be a string or a list of token ids")
    return items
