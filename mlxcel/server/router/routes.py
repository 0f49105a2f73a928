"""The router's own routes: the model list and objects, load and unload, health and props.

`GET /models` (and `/v1/models`) lists every model with its `status` (`unloaded`, `loading`,
`loaded`, `sleeping`; a failed last load adds `failed`), as llama-server's router does.
`POST /models/load` loads a model and answers once it is loaded; `POST /models/unload`
unloads one; `POST /models/reload` reads the models again; `GET /models/sse` streams status
changes. `GET /props` without `?model=` describes the router (`role: "router"`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

from mlxcel import __version__
from mlxcel.server.errors import (
    RETRY_AFTER_SECONDS,
    APIError,
    anthropic_error_body,
    install_error_handlers,
)
from mlxcel.server.health import is_draining
from mlxcel.server.json_body import decode_json_body
from mlxcel.server.models_route import anthropic_list, anthropic_model, wants_anthropic
from mlxcel.server.router.catalog import ModelEntry, ModelKind
from mlxcel.server.router.dispatch import checkout, unknown_model
from mlxcel.server.router.pool import ModelPool, ModelStatus, RoutedModel
from mlxcel.server.sse import event_stream, sse_data
from mlxcel.server.state import ServerState

router = APIRouter()

_INPUTS = {
    ModelKind.VISION: ["text", "image"],
    ModelKind.TRANSCRIPTION: ["audio"],
    ModelKind.IMAGE: ["text", "image"],
}
_OUTPUTS = {
    ModelKind.EMBEDDING: [],
    ModelKind.RERANK: [],
    ModelKind.SPEECH: ["audio"],
    ModelKind.IMAGE: ["image"],
}


def _pool(request: Request) -> ModelPool:
    pool: ModelPool = request.app.state.router_pool
    return pool


def model_object(model: RoutedModel, created: int) -> dict[str, Any]:
    """One model of the list: OpenAI's model object plus llama-server's router fields."""
    entry = model.entry
    status: dict[str, Any] = {
        "value": model.status.value,
        "args": ["mlxcel", "serve", "-m", entry.ref, *entry.args],
    }
    if model.failure is not None and model.status is ModelStatus.UNLOADED:
        status["failed"] = True
    return {
        "id": entry.name,
        "aliases": list(entry.aliases),
        "tags": entry.settings.tag_names(),
        "object": "model",
        "owned_by": "user",
        "created": created,
        "status": status,
        "path": entry.ref,
        "kind": entry.kind.value,
        "pinned": entry.pinned,
        "source": entry.source,
        "architecture": {
            "input_modalities": _INPUTS.get(entry.kind, ["text"]),
            "output_modalities": _OUTPUTS.get(entry.kind, ["text"]),
        },
    }


@router.get("/v1/models")
@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Every model of the router with its status (Anthropic's list to its SDK); with
    `?reload=1` the directory and the preset are read again first."""
    created = int(request.app.state.mlxcel.started)
    if request.query_params.get("reload", "") not in ("", "0", "false"):
        await _reload(request)
    models = _pool(request).models
    if wants_anthropic(request):
        names = [m.entry.name for m in models]
        return anthropic_list([anthropic_model(name, name, created) for name in names])
    return {"object": "list", "data": [model_object(m, created) for m in models]}


async def _reload(request: Request) -> None:
    """Read the models again (off the event loop); a directory or preset that no longer
    reads is a 400 and leaves the models as they were."""
    from mlxcel.config import SettingsError

    read: Callable[[], list[ModelEntry]] = request.app.state.read_models
    try:
        entries = await asyncio.get_running_loop().run_in_executor(None, read)
    except SettingsError as exc:
        raise APIError(400, f"reload: {exc}") from None
    _pool(request).reload(entries)


SSE_POLL_SECONDS = 0.1
SSE_PING_SECONDS = 15.0


@router.get("/models/sse")
async def model_events(request: Request) -> StreamingResponse:
    """llama-server's model events as server-sent events: `model_status` (`data.status`)
    when a model's status changes, `model_remove` and `models_reload` (`model: "*"`) when
    a reload changes the list; a comment line every 15 s keeps the stream open."""
    pool = _pool(request)

    def statuses() -> dict[str, str]:
        return {m.entry.name: m.status.value for m in pool.models}

    async def events() -> AsyncIterator[str]:
        seen = statuses()
        quiet = 0.0
        while True:
            await asyncio.sleep(SSE_POLL_SECONDS)
            now = statuses()
            out: list[dict[str, Any]] = []
            if now.keys() != seen.keys():
                out.append({"model": "*", "event": "models_reload"})
                out += [{"model": n, "event": "model_remove"} for n in seen.keys() - now.keys()]
            for name, value in now.items():
                if seen.get(name) != value:
                    out.append({"model": name, "event": "model_status", "data": {"status": value}})
            seen = now
            quiet = 0.0 if out else quiet + SSE_POLL_SECONDS
            for event in out:
                yield sse_data(event)
            if quiet >= SSE_PING_SECONDS:
                quiet = 0.0
                yield ": ping\n\n"

    return event_stream(events(), on_close=lambda: None)


@router.get("/v1/models/{model_id:path}", response_model=None)
@router.get("/models/{model_id:path}", response_model=None)
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any] | JSONResponse:
    """The model `model_id` names (its name or an alias); 404 otherwise."""
    model = _pool(request).find(model_id)
    created = int(request.app.state.mlxcel.started)
    anthropic = wants_anthropic(request)
    if model is None:
        message = f"The model '{model_id[:200]}' does not exist"
        if anthropic:
            return JSONResponse(anthropic_error_body(message, 404), status_code=404)
        raise APIError(404, message, code="model_not_found", extra={"param": "model"})
    if anthropic:
        return anthropic_model(model.entry.name, model.entry.name, created)
    return model_object(model, created)


async def _named(request: Request) -> RoutedModel:
    payload = decode_json_body(await request.body())
    name = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "model name is missing from the request", extra={"param": "model"})
    model = _pool(request).find(name)
    if model is None:
        raise unknown_model(name, _pool(request))
    return model


@router.post("/models/load")
async def load_model(request: Request) -> dict[str, Any]:
    """Load a model; answers once it is loaded (400 when it already is)."""
    model = await _named(request)
    if model.status in (ModelStatus.LOADED, ModelStatus.SLEEPING):
        raise APIError(400, f"model '{model.entry.name}' is already loaded")
    pool = _pool(request)
    pool.release(model, await checkout(pool, model, request.app.state.load_timeout))
    return {"success": True}


@router.post("/models/reload")
async def reload_models(request: Request) -> dict[str, Any]:
    """Read the directory and the preset again (as `GET /models?reload=1`)."""
    await _reload(request)
    return {"success": True}


@router.post("/models/unload")
async def unload_model(request: Request) -> dict[str, Any]:
    """Unload a model (400 when it is not loaded)."""
    model = await _named(request)
    if not _pool(request).unload(model):
        raise APIError(400, f"model '{model.entry.name}' is not loaded")
    return {"success": True}


@router.get("/health")
@router.get("/")
async def health(request: Request) -> JSONResponse:
    """The router is up (503 while draining); each model's health is `/health?model=`."""
    state: ServerState = request.app.state.mlxcel
    if is_draining(state):
        return JSONResponse(
            {"status": "draining"}, status_code=503, headers={"Retry-After": RETRY_AFTER_SECONDS}
        )
    return JSONResponse({"status": "ok"})


@router.get("/props")
async def router_props(request: Request) -> dict[str, Any]:
    """What the router is (a model's own props: `/props?model=NAME`)."""
    pool = _pool(request)
    return {
        "role": "router",
        "max_instances": pool.models_max,
        "models_autoload": pool.autoload,
        "model_alias": "mlxcel",
        "model_path": "none",
        "default_generation_settings": {"params": {}, "n_ctx": 0},
        "build_info": f"mlxcel-{__version__}",
    }


def control_app(
    state: ServerState,
    pool: ModelPool,
    load_timeout: float | None,
    read_models: Callable[[], list[ModelEntry]],
) -> FastAPI:
    """The FastAPI app of the router's own routes (`read_models`: the catalog read again,
    for `?reload=1`)."""
    app = FastAPI(title="mlxcel-router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mlxcel = state
    app.state.router_pool = pool
    app.state.load_timeout = load_timeout
    app.state.read_models = read_models
    install_error_handlers(app)
    app.include_router(router, prefix=_prefix(state))
    return app


def _prefix(state: ServerState) -> str:
    from mlxcel.server.app import normalize_prefix

    return normalize_prefix(state.settings.api_prefix)
