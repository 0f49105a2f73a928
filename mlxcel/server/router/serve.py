"""Router mode for the runner: the catalog, the pool and the app, as one `Serving`.

Before the port opens, the directory and the preset are read and every model's settings
checked the way a single-model server checks its own (no weights read): a bad preset
option refuses to start, a model that cannot be loaded is listed and answers its requests
with the reason. Once listening, the `load-on-startup` models load.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Collection
from functools import partial

from starlette.types import ASGIApp

from mlxcel.config import Settings, SettingsError
from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.process_memory import release_memory
from mlxcel.server.app import cors_options, guard_options, normalize_prefix
from mlxcel.server.boot import announce, check_settings, load_into, stop_services
from mlxcel.server.io_timeout import IoTimeout
from mlxcel.server.middleware import Cors, RequestGuard
from mlxcel.server.ops.routes import metrics_app
from mlxcel.server.router.catalog import Catalog, ModelEntry, build_catalog
from mlxcel.server.router.dispatch import RouterDispatch
from mlxcel.server.router.metrics import router_metrics_text
from mlxcel.server.router.pool import ModelPool
from mlxcel.server.router.routes import control_app
from mlxcel.server.runner import Serving
from mlxcel.server.state import ServerState

DEFAULT_LOAD_WAIT_SECONDS = 600.0


def memory_budget() -> int:
    """The memory models may take: `MLXCEL_REQUEST_MEMORY_BUDGET`, else the machine's."""
    from mlxcel.engine.text.memory_budget import configured_budget, device_memory_limit

    configured = configured_budget()
    return configured if configured is not None else device_memory_limit()


def check_catalog(catalog: Catalog) -> None:
    """Check every model's settings as `mlxcel serve -m` would (SettingsError refuses to
    start); a model reference that cannot be loaded only warns."""
    for entry in catalog.entries:
        try:
            check_settings(entry.settings)
        except ModelLoadError as exc:
            catalog.warnings.append(f"model {entry.name}: {str(exc).splitlines()[0]}")
        except SettingsError as exc:
            raise SettingsError(f"model {entry.name}: {exc}") from None


def _load_and_announce(state: ServerState) -> None:
    """Load a model as `mlxcel serve -m` does; what it loaded joins the objects the cyclic
    collector's full passes skip (as the runner does after a single model's load)."""
    load_into(state)
    announce(state)
    gc.freeze()


def release_unloaded() -> None:
    """Return an unloaded model's memory: frozen objects are never collected, and a model's
    engine holds reference cycles, so the loaded objects are unfrozen for one collection
    (`release_memory`) and the models still loaded frozen again."""
    gc.unfreeze()
    release_memory()
    gc.freeze()


def model_reader(
    settings: Settings, cli_fields: Collection[str] = ()
) -> Callable[[], list[ModelEntry]]:
    """What reads the router's models (at start and on `?reload=1`): the catalog, checked,
    its warnings printed (SettingsError when it cannot be read or is empty)."""

    def read_models() -> list[ModelEntry]:
        catalog = build_catalog(settings, cli_fields)
        check_catalog(catalog)
        if not catalog.entries:
            raise SettingsError("--models-dir/--models-preset: no models found")
        for line in catalog.warnings:
            print(f"mlxcel: warning: {line}", file=sys.stderr, flush=True)
        return catalog.entries

    return read_models


def router_pool(settings: Settings, entries: list[ModelEntry]) -> ModelPool:
    """The pool of `entries`, loading each model as `mlxcel serve -m` loads it."""
    return ModelPool(
        entries,
        models_max=settings.models_max,
        autoload=settings.models_autoload,
        make_app=_model_app,
        load=_load_and_announce,
        stop=stop_services,
        memory_budget=memory_budget,
        release=release_unloaded,
    )


def router_serving(settings: Settings, cli_fields: Collection[str] = ()) -> Serving:
    """Everything a router server runs (SettingsError when it cannot start); with
    `--metrics-port`, that port serves every loaded model's metrics, labelled by model."""
    read_models = model_reader(settings, cli_fields)
    pool = router_pool(settings, read_models())
    state = ServerState(settings=settings, text_engine=False)
    wait = float(settings.timeout) if settings.timeout > 0 else DEFAULT_LOAD_WAIT_SECONDS
    return Serving(
        state=state,
        app=router_app(state, pool, wait, read_models),
        load=lambda: _load_on_startup(pool),
        announce=lambda: _announce(pool),
        busy=pool.busy,
        stop=pool.stop_all,
        metrics=metrics_app(state, partial(router_metrics_text, pool)),
    )


def _model_app(state: ServerState) -> ASGIApp:
    from mlxcel.server.app import create_app

    return create_app(state)


def router_app(
    state: ServerState,
    pool: ModelPool,
    load_timeout: float,
    read_models: Callable[[], list[ModelEntry]],
) -> ASGIApp:
    """The router's ASGI app: the same guards as a single-model server (API keys, size
    caps, CORS, I/O timeout) around the dispatch."""
    settings = state.settings
    prefix = normalize_prefix(settings.api_prefix)
    dispatch = RouterDispatch(
        control_app(state, pool, load_timeout, read_models),
        pool,
        prefix=prefix,
        load_timeout=load_timeout,
        settings=settings,
    )
    app: ASGIApp = RequestGuard(dispatch, **guard_options(settings, prefix))
    cors = cors_options(settings)
    if cors is not None:
        app = Cors(app, **cors)  # type: ignore[arg-type]
    return IoTimeout(app, seconds=settings.timeout)


def _load_on_startup(pool: ModelPool) -> None:
    for model in pool.models:
        if model.entry.load_on_startup:
            try:
                pool.start_load(model).result()
            except Exception as exc:  # noqa: BLE001 - the server stays up; the list says failed
                print(f"mlxcel: warning: {exc}", file=sys.stderr, flush=True)


def _announce(pool: ModelPool) -> None:
    names = ", ".join(pool.names())
    limit = pool.models_max or "no limit"
    autoload = "on" if pool.autoload else "off"
    print(
        f"mlxcel: router: {len(pool.models)} models ({names}); --models-max {limit}, "
        f"autoload {autoload}",
        file=sys.stderr,
        flush=True,
    )
