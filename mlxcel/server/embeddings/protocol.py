"""Request bodies of the embedding routes, and the input normalization they share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlxcel.server.errors import bad_request

EmbeddingItem = str | list[int] | list[int | str]


class OpenAIEmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI), plus llama-server's `embd_normalize` and a `truncate` flag.

    An input over the model's limit is refused, as OpenAI and llama-server do, unless
    `truncate` is true (then it is cut and its item says `truncated: true`).
    """

    model_config = ConfigDict(extra="allow")

    input: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    embd_normalize: int | None = Field(None, ge=-1)
    truncate: bool = False


class NativeEmbeddingRequest(BaseModel):
    """POST /embedding and /embeddings (llama-server): `content` or `input`.

    An input over the model's limit is refused as llama-server does, unless `truncate`.
    """

    model_config = ConfigDict(extra="allow")

    content: Any = None
    input: Any = None
    embd_normalize: int | None = Field(None, ge=-1)
    truncate: bool = False

    def items(self) -> Any:
        """`content`, else `input`."""
        return self.content if self.content is not None else self.input


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_token(x) for x in value)


def _is_prompt_list(value: Any) -> bool:
    """A list of token ids, possibly mixed with texts (llama-server's one-prompt form)."""
    return (
        isinstance(value, list)
        and any(_is_token(x) for x in value)
        and all(_is_token(x) or isinstance(x, str) for x in value)
    )


def embedding_inputs(value: Any, *, field: str = "input", max_inputs: int) -> list[EmbeddingItem]:
    """A request's input as a list of texts and token-id lists (400 when malformed).

    As llama-server reads prompts: a string, or a list holding token ids (one input; texts
    among the ids are tokenized in place, `[12, "text", 34]`), or a list whose items are
    strings or such lists. An empty string is an input (the model's special tokens alone);
    an empty list, an empty token list and more than `max_inputs` items are refused.
    """
    if value is None:
        raise bad_request(f"'{field}' is required")
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_prompt_list(value):
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
            continue
        if isinstance(item, list) and not item:
            raise bad_request(f"'{field}[{i}]' is an empty token list")
        if not _is_prompt_list(item):
            raise bad_request(
                f"'{field}[{i}]' must be a string or a list of token ids (texts may be mixed in)"
            )
    return items
