"""GET /v1/models (and /models): the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from mlxcel.server.state import ServerState, get_state

router = APIRouter()


def models_payload(state: ServerState) -> dict[str, Any]:
    """The OpenAI model list: one entry, named by `--alias` or the model's name.

    As llama-server: `--alias a,b` gives every alias in `aliases` and the first of them
    (sorted) as `id`, the name every other route reports too; `tags` lists `--tags`.
    """
    aliases = state.settings.alias_names() or [state.model_name]
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "aliases": aliases,
                "tags": state.settings.tag_names(),
                "object": "model",
                "created": int(state.started),
                "owned_by": "user",
            }
        ],
    }


@router.get("/v1/models")
@router.get("/models")
async def list_models(state: ServerState = Depends(get_state)) -> dict[str, Any]:
    """List the served model."""
    return models_payload(state)
