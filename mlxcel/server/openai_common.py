"""Request and answer pieces every generation route uses, whatever its API family:
reading a JSON body, response ids and timestamps, the reported model name, and the OpenAI
shapes (`usage`, logprob entries, the speculative `timings`) that several families reuse.
"""

from __future__ import annotations

import secrets
import string
import time
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from mlxcel.engine.text.request import GenerationEvent, TokenLogprob
from mlxcel.server.errors import scrub_paths as scrub_paths  # re-exported (runner.py uses it)
from mlxcel.server.json_body import read_json_body
from mlxcel.server.sse import sse_data

if TYPE_CHECKING:
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.state import ServerState

M = TypeVar("M", bound=BaseModel)

_ID_ALPHABET = string.ascii_letters + string.digits


class StreamOptions(BaseModel):
    """`stream_options` of the chat and text completion bodies: only `include_usage` has a
    meaning here."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


def new_id(prefix: str) -> str:
    """A response id such as `chatcmpl-<24 random characters>`."""
    return prefix + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the Content-Type (llama-server ignores it too).

    The body is read by `read_json_body` (bad JSON, too deep, not valid Unicode: 400);
    validation failures are 400 `invalid_request_error` too.
    """
    payload = await read_json_body(request)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None


def now() -> int:
    """The `created` timestamp: whole seconds since the epoch."""
    return int(time.time())


def reported_model(state: ServerState, requested: str | None) -> str:
    """The `model` to answer with: the request's own value echoed, else the served name.

    The field never selects, loads or reads anything: one model per server.
    """
    if isinstance(requested, str) and requested.strip():
        return requested
    return state.model_name


def envelope(meta: dict[str, Any], object: str) -> dict[str, Any]:
    """The leading fields of a response or chunk, in the spec's order."""
    return {
        "id": meta["id"],
        "object": object,
        "created": meta["created"],
        "model": meta["model"],
        "system_fingerprint": None,
    }


def choice_chunk(
    meta: dict[str, Any],
    object: str,
    choice: dict[str, Any],
    extra: dict[str, Any] | None = None,
    index: int = 0,
) -> str:
    """One SSE chunk of an OpenAI stream: the envelope, `extra`, and one choice's fields."""
    return sse_data(
        {**envelope(meta, object), **(extra or {}), "choices": [{"index": index, **choice}]}
    )


def usage_chunk(
    meta: dict[str, Any], object: str, finals: list[GenerationEvent], *, timings: bool = False
) -> str:
    """The `stream_options.include_usage` chunk: no choices, the request's `usage` (and with
    `timings`, llama-server's `timings` of the first choice, as its last chunk has)."""
    chunk = {**envelope(meta, object), "choices": [], "usage": usage_of(finals)}
    if timings and finals[0].timings is not None:
        chunk["timings"] = finals[0].timings.to_dict()
    return sse_data(chunk)


def usage_of(finals: list[GenerationEvent]) -> dict[str, Any]:
    """The `usage` of a request from its choices' final events: the prompt counted once,
    completion tokens summed over the choices, the prompt-cache hit of the first choice."""
    first = finals[0]
    cached = first.timings.cache_n if first.timings is not None else 0
    return usage_payload(
        first.prompt_tokens, sum(f.completion_tokens for f in finals), cached_tokens=cached
    )


def usage_payload(
    prompt_tokens: int, completion_tokens: int, *, cached_tokens: int = 0
) -> dict[str, Any]:
    """The OpenAI `usage` object; `prompt_tokens_details.cached_tokens` is how many prompt
    tokens the prompt cache served."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _logprob_item(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "id": token_id,
        "token": tokenizer.piece(token_id),
        "logprob": logprob,
        "bytes": list(tokenizer.piece_bytes(token_id)),
    }


def chat_logprobs(tokenizer: Tokenizer, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat-style logprob entries (`choices[].logprobs.content`)."""
    out: list[dict[str, Any]] = []
    for item in items:
        entry = _logprob_item(tokenizer, item.token_id, item.logprob)
        entry["top_logprobs"] = [_logprob_item(tokenizer, t, lp) for t, lp in item.top]
        out.append(entry)
    return out


def speculative_timings(final: GenerationEvent) -> dict[str, Any]:
    """`{"timings": ...}` when speculative decoding ran a verify round for the request, else
    `{}`: spread into a non-streamed answer or the stream chunk carrying finish_reason."""
    timings = final.timings
    if timings is None or timings.draft_rounds <= 0:
        return {}
    return {"timings": timings.to_dict()}
