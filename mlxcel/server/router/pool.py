"""The router's models at run time: which are loaded, loading them on demand, unloading.

Each loaded model is a `Service`: its own `ServerState`, filled by `boot.load_into` exactly
as a single-model server's, and its own app (`app.create_app`). Loads run one at a time on
the loader thread, never on the event loop; a request for a model that is loading waits for
that one load. Before a load, room is made: at `--models-max` the least recently used
model that is neither pinned nor serving a request is unloaded, and so are idle models
while the new model's weights would not fit the memory budget (`MLXCEL_REQUEST_MEMORY_BUDGET`,
else the machine's); when nothing can go, the load is refused (`PoolFull`, `MemoryRefused`).
"""

from __future__ import annotations

import asyncio
import enum
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from starlette.types import ASGIApp

from mlxcel.server.router.catalog import ModelEntry
from mlxcel.server.state import ServerState


class ModelStatus(str, enum.Enum):
    """A model's status as `GET /models` reports it (llama-server's values)."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    SLEEPING = "sleeping"


class PoolFull(Exception):
    """No model can be unloaded to stay within `--models-max` (all pinned or busy)."""


class MemoryRefused(Exception):
    """The model's weights would not fit the memory budget, even with idle models unloaded."""

    def __init__(self, message: str, needed: int, budget: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.budget = budget


class LoadFailed(Exception):
    """The model could not be loaded (the loader's one-line reason)."""


@dataclass
class Service:
    """One loaded model: its state (engine, workers) and the app that serves it."""

    state: ServerState
    app: ASGIApp
    in_flight: int = 0  # requests being served (a busy model is never evicted)


class RoutedModel:
    """One model of the router and what it is doing now."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.service: Service | None = None
        self.loading: Future[Service] | None = None
        self.last_used = 0.0
        self.failure: str | None = None  # why the last load failed

    @property
    def status(self) -> ModelStatus:
        if self.loading is not None:
            return ModelStatus.LOADING
        service = self.service
        if service is None:
            return ModelStatus.UNLOADED
        engine = service.state.engine
        return (
            ModelStatus.SLEEPING if engine is not None and engine.sleeping else ModelStatus.LOADED
        )


@dataclass
class PoolCounters:
    """What the pool has done since the server started (the router's own metrics)."""

    loads: int = 0  # loads that worked
    load_failures: int = 0  # loads that failed, or were refused for want of room
    evictions: int = 0  # models unloaded to make room for another
    unloads: int = 0  # models unloaded on request (`POST /models/unload`, a reload)


Loader = Callable[[ServerState], None]
Stopper = Callable[[ServerState], None]


class ModelPool:
    """The router's models: lookup by name or alias, load, unload, least-recently-used."""

    def __init__(
        self,
        entries: list[ModelEntry],
        *,
        models_max: int,
        autoload: bool,
        make_app: Callable[[ServerState], ASGIApp],
        load: Loader,
        stop: Stopper,
        memory_budget: Callable[[], int | None] = lambda: None,
        release: Callable[[], None] = lambda: None,
    ) -> None:
        """`load` fills a model's state, `stop` stops what it started; `release` returns the
        memory of models stopped and dropped to the system."""
        self.models = [RoutedModel(entry) for entry in entries]
        self.models_max = models_max
        self.autoload = autoload
        self._make_app = make_app
        self._load = load
        self._stop = stop
        self._memory_budget = memory_budget
        self._release = release
        self._by_name = {name: m for m in self.models for name in m.entry.names()}
        self._lock = threading.Lock()  # guards every model's service/loading, the counters
        self.counters = PoolCounters()
        # One loader thread for all loads (one at a time), and a few threads that stop
        # unloaded models: threads that live on, as a thread that first uses MLX keeps
        # MLX's per-thread state (its streams) for the life of the process.
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-router-load")
        self._stopper = ThreadPoolExecutor(4, thread_name_prefix="mlxcel-router-unload")

    # ------------------------------------------------------------------ lookup

    def find(self, name: str) -> RoutedModel | None:
        """The model `name` (its name or an alias) names, else None."""
        return self._by_name.get(name)

    def names(self) -> list[str]:
        """Every model's name, sorted."""
        return [m.entry.name for m in self.models]

    def busy(self) -> bool:
        """Whether any model is serving a request or loading for one (a drain waits for
        both: a request waiting for its model is in flight too)."""
        return any(
            m.loading is not None or (m.service is not None and m.service.in_flight)
            for m in self.models
        )

    # ------------------------------------------------------------------ load

    def start_load(self, model: RoutedModel) -> Future[Service]:
        """The load of `model`: done when it is loaded, the running one while it loads,
        else a new one on a loader thread."""
        with self._lock:
            if model.service is not None:
                done: Future[Service] = Future()
                done.set_result(model.service)
                return done
            if model.loading is not None:
                return model.loading
            future: Future[Service] = Future()
            model.loading = future
            model.failure = None
            model.last_used = time.monotonic()
        self._loader.submit(self._run_load, model, future)
        return future

    async def ready(self, model: RoutedModel, timeout: float | None) -> Service:
        """The loaded `model`, loading it first if needed and waiting at most `timeout`
        seconds (TimeoutError; PoolFull, MemoryRefused or LoadFailed when it cannot load)."""
        future = self.start_load(model)
        if future.done():
            return future.result()
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)

    async def checkout(self, model: RoutedModel, timeout: float | None) -> Service:
        """`ready(model)`, counted as serving one more request until `release`: from then on
        it is not evicted (a model unloaded between its load and this count loads again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            service = await self.ready(model, left)
            with self._lock:
                if model.service is service:
                    service.in_flight += 1
                    model.last_used = time.monotonic()
                    return service

    def release(self, model: RoutedModel, service: Service) -> None:
        """One request `checkout` counted is over."""
        with self._lock:
            service.in_flight -= 1
            model.last_used = time.monotonic()

    def _run_load(self, model: RoutedModel, future: Future[Service]) -> None:
        try:
            self._make_room(model)
            service = self._build(model)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            with self._lock:
                model.loading = None
                model.failure = str(exc)
                self.counters.load_failures += 1
            future.set_exception(exc)
            return
        with self._lock:
            model.service = service
            model.loading = None
            model.last_used = time.monotonic()
            self.counters.loads += 1
        future.set_result(service)

    def _build(self, model: RoutedModel) -> Service:
        state = ServerState(settings=model.entry.settings)
        try:
            self._load(state)
        except Exception as exc:
            self._stop(state)
            del state
            self._release()
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LoadFailed(f"model {model.entry.name} could not be loaded: {text}") from None
        return Service(state, self._make_app(state))

    def _make_room(self, model: RoutedModel) -> None:
        """Unload idle models until `model` fits `--models-max` and the memory budget."""
        if self.models_max > 0:
            while len(self._holding(model)) >= self.models_max:
                if not self._evict_one(model):
                    raise PoolFull(
                        f"{self.models_max} models are loaded (--models-max) and none can be "
                        "unloaded now (pinned or serving requests); try again later"
                    )
        budget = self._memory_budget()
        if budget is None:
            return
        needed = model.entry.weight_bytes
        while needed + sum(m.entry.weight_bytes for m in self._holding(model)) > budget:
            if not self._evict_one(model):
                raise MemoryRefused(
                    f"model {model.entry.name} needs about {needed} bytes for its weights; with "
                    f"the models loaded it would not fit the memory budget of {budget} bytes",
                    needed,
                    budget,
                )

    def _holding(self, model: RoutedModel) -> list[RoutedModel]:
        """The other models that are loaded or loading."""
        return [m for m in self.models if m is not model and (m.service is not None or m.loading)]

    def _evict_one(self, model: RoutedModel) -> bool:
        """Unload the least recently used idle, unpinned model other than `model`."""
        with self._lock:
            idle = [
                m
                for m in self.models
                if m is not model
                and m.service is not None
                and not m.service.in_flight
                and not m.entry.pinned
            ]
            if not idle:
                return False
            victim = min(idle, key=lambda m: m.last_used)
            service, victim.service = victim.service, None
            self.counters.evictions += 1
        assert service is not None
        print(
            f"mlxcel: router: unloading {victim.entry.name} (least recently used) "
            f"to load {model.entry.name}",
            file=sys.stderr,
            flush=True,
        )
        self._stop(service.state)
        del service
        self._release()
        return True

    # ------------------------------------------------------------------ reload

    def reload(self, entries: list[ModelEntry]) -> None:
        """Take `entries` as the models from now on (`GET /models?reload=1`): new ones are
        added, gone ones removed, changed ones updated; a loaded model that is gone or
        changed is unloaded (its next request loads the new one)."""
        with self._lock:
            current = {m.entry.name: m for m in self.models}
            models: list[RoutedModel] = []
            stale: list[RoutedModel] = []
            for entry in entries:
                model = current.pop(entry.name, None)
                if model is None:
                    model = RoutedModel(entry)
                elif model.entry != entry:
                    model.entry = entry
                    stale.append(model)
                models.append(model)
            stale += current.values()
            self.models = models
            self._by_name = {name: m for m in models for name in m.entry.names()}
        for model in stale:
            self.unload(model)

    # ------------------------------------------------------------------ unload

    def unload(self, model: RoutedModel) -> bool:
        """Unload `model` (False when it is not loaded): it stops routing now, and stops once
        its requests finished or its `stop-timeout` passed."""
        with self._lock:
            service, model.service = model.service, None
            if service is not None:
                self.counters.unloads += 1
        if service is None:
            return False
        box = [service]  # the thread pops it: nothing keeps the model once it stopped
        del service
        self._stopper.submit(self._stop_when_idle, box, model.entry.stop_timeout)
        return True

    def _stop_when_idle(self, box: list[Service], timeout: float) -> None:
        service = box.pop()
        deadline = time.monotonic() + timeout
        while service.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop(service.state)
        del service
        self._release()

    def stop_all(self) -> None:
        """Stop every loaded model (the server is stopping). A load in flight finishes
        first and queued ones are dropped: a model that became ready after the others
        stopped kept its engine running while the process exited, which could abort it."""
        self._loader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            services = [m.service for m in self.models if m.service is not None]
            dropped = [m.loading for m in self.models if m.loading is not None]
            for m in self.models:
                m.service = None
                m.loading = None
        for future in dropped:
            if not future.done():
                future.set_exception(LoadFailed("the server is stopping"))
        for service in services:
            self._stop(service.state)
        self._stopper.shutdown(wait=True)  # unloads under way end before the process does
