"""GET /v1/models and /v1/models/{id} (also without /v1): the one model this server serves.

OpenAI's shape by default; a request with an `anthropic-version` header (as the official
`anthropic` SDK sends) gets Anthropic's: `type: "model"`, `display_name`, `created_at`
(RFC 3339), and a list with `has_more`, `first_id` and `last_id`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse

from mlxcel.server.errors import APIError, anthropic_error_body
from mlxcel.server.state import ServerState, get_state

router = APIRouter()

ANTHROPIC_VERSION_HEADER = "anthropic-version"


def models_payload(state: ServerState) -> dict[str, Any]:
    """The OpenAI model list: one entry, named by `--alias` or the model's name.

    As llama-server: `--alias a,b` gives every alias in `aliases` and the first of them
    (sorted) as `id`, the name every other route reports too; `tags` lists `--tags`.
    """
    return {"object": "list", "data": [model_object(state)]}


def model_object(state: ServerState) -> dict[str, Any]:
    """The OpenAI model object of the served model (one entry of the list)."""
    return {
        "id": state.model_name,
        "aliases": state.settings.alias_names() or [state.model_name],
        "tags": state.settings.tag_names(),
        "object": "model",
        "created": int(state.started),
        "owned_by": "user",
    }


def anthropic_model(model_id: str, display_name: str, created: float) -> dict[str, Any]:
    """Anthropic's model object (`created`: a Unix time)."""
    started = datetime.fromtimestamp(int(created), tz=timezone.utc)
    return {
        "type": "model",
        "id": model_id,
        "display_name": display_name,
        "created_at": started.isoformat().replace("+00:00", "Z"),
    }


def anthropic_list(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's model list: one page holding `entries` (at least one)."""
    return {
        "data": entries,
        "has_more": False,
        "first_id": entries[0]["id"],
        "last_id": entries[-1]["id"],
    }


def anthropic_model_object(state: ServerState) -> dict[str, Any]:
    """The served model as Anthropic's model object."""
    display = state.model_info.name if state.model_info is not None else state.model_name
    return anthropic_model(state.model_name, display, state.started)


def anthropic_models_payload(state: ServerState) -> dict[str, Any]:
    """Anthropic's model list (one page holding the one model)."""
    return anthropic_list([anthropic_model_object(state)])


def served_names(state: ServerState) -> set[str]:
    """Every id the served model answers to: the reported name, each alias, the model's name."""
    names = {state.model_name, *state.settings.alias_names()}
    if state.model_info is not None:
        names.add(state.model_info.name)
    return names


def wants_anthropic(raw: Request) -> bool:
    """Whether the client speaks Anthropic's API (it sent `anthropic-version`)."""
    return ANTHROPIC_VERSION_HEADER in raw.headers


@router.get("/v1/models")
@router.get("/models")
async def list_models(raw: Request, state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """List the served model."""
    if wants_anthropic(raw):
        return anthropic_models_payload(state)
    return models_payload(state)


@router.get("/v1/models/{model_id:path}", response_model=None)
@router.get("/models/{model_id:path}", response_model=None)
async def retrieve_model(
    model_id: str, raw: Request, state: ServerState = Depends(get_state)
) -> dict[str, Any] | JSONResponse:
    """The served model's object when `model_id` names it (its id or an alias); else 404."""
    anthropic = wants_anthropic(raw)
    if model_id not in served_names(state):
        message = f"The model '{model_id}' does not exist"
        if anthropic:
            return JSONResponse(anthropic_error_body(message, 404), status_code=404)
        raise APIError(404, message, code="model_not_found", extra={"param": "model"})
    return anthropic_model_object(state) if anthropic else model_object(state)
