"""GET /v1/models (and /models): the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from mlxcel.server.state import ServerState, get_state

router = APIRouter()


def _names(value: object) -> list[str]:
    """A comma-separated setting as a sorted list of distinct names."""
    if not isinstance(value, str):
        return []
    return sorted({item.strip() for item in value.split(",") if item.strip()})


def models_payload(state: ServerState) -> dict[str, Any]:
    """The OpenAI model list: one entry, named by `--alias` or the model's name.

    As llama-server: `--alias a,b` gives every alias in `aliases` and the first of them
    (sorted) as `id`; `tags` lists `--tags`.
    """
    aliases = _names(state.settings.alias) or [state.model_name]
    model_id = aliases[0] if len(aliases) > 1 else state.model_name
    return {
        "object": "list",
        "data": [
            {
                "id": model_id,
                "aliases": aliases,
                "tags": _names(getattr(state.settings, "tags", None)),
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
