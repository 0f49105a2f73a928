"""Router mode's parts without a server: the pool's eviction rules, the directory scan and
the preset file (the end-to-end tests are tests/test_router.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import weakref
from pathlib import Path

import pytest

from mlxcel.config import Settings, SettingsError
from mlxcel.server.router.catalog import ModelEntry, ModelKind, build_catalog, scan_models_dir
from mlxcel.server.router.pool import (
    LoadFailed,
    MemoryRefused,
    ModelPool,
    ModelStatus,
    PoolFull,
)
from mlxcel.server.router.preset import read_preset
from mlxcel.server.state import ServerState


class Loads:
    """Fake load and stop: which models loaded and stopped, a load that can be held."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.stopped: list[str] = []
        self.fail: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def load(self, state: ServerState) -> None:
        self.gate.wait(10)
        name = str(state.settings.alias)
        if name in self.fail:
            raise RuntimeError(f"{name}: broken weights")
        self.loaded.append(name)

    def stop(self, state: ServerState) -> None:
        self.stopped.append(str(state.settings.alias))


def entry(name: str, *, weight: int = 100, pinned: bool = False, stop: float = 10) -> ModelEntry:
    return ModelEntry(
        name=name,
        ref=f"/models/{name}",
        kind=ModelKind.TEXT,
        settings=Settings(alias=name),
        source="models_dir",
        pinned=pinned,
        weight_bytes=weight,
        stop_timeout=stop,
    )


def pool(
    *entries: ModelEntry, models_max: int = 4, budget: int | None = None
) -> tuple[ModelPool, Loads]:
    loads = Loads()
    made = ModelPool(
        list(entries),
        models_max=models_max,
        autoload=True,
        make_app=lambda state: object(),  # type: ignore[arg-type,return-value]
        load=loads.load,
        stop=loads.stop,
        memory_budget=lambda: budget,
    )
    return made, loads


def use(p: ModelPool, name: str) -> None:
    """One request to `name`, start to end."""
    model = p.find(name)
    assert model is not None

    async def once() -> None:
        p.release(model, await p.checkout(model, 10))

    asyncio.run(once())


def status(p: ModelPool) -> dict[str, str]:
    return {m.entry.name: m.status.value for m in p.models}


def test_the_least_recently_used_model_makes_room() -> None:
    p, loads = pool(entry("a"), entry("b"), entry("c"), models_max=2)
    use(p, "a")
    use(p, "b")
    use(p, "a")  # b is now the least recently used
    use(p, "c")
    assert status(p) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert loads.stopped == ["b"] and loads.loaded == ["a", "b", "c"]


def test_pinned_and_busy_models_are_never_evicted() -> None:
    p, _ = pool(entry("a", pinned=True), entry("b"), entry("c"), models_max=1)
    use(p, "a")
    with pytest.raises(PoolFull):
        use(p, "b")
    assert status(p)["a"] == "loaded"

    q, loads = pool(entry("a"), entry("b"), models_max=1)
    a = q.find("a")
    assert a is not None

    async def scenario() -> None:
        service = await q.checkout(a, 10)  # a request in flight on a
        with pytest.raises(PoolFull):
            await q.checkout(q.models[1], 10)
        q.release(a, service)
        q.release(q.models[1], await q.checkout(q.models[1], 10))

    asyncio.run(scenario())
    assert status(q) == {"a": "unloaded", "b": "loaded"} and loads.stopped == ["a"]


def test_memory_budget_evicts_idle_models_then_refuses() -> None:
    p, loads = pool(entry("a"), entry("b"), entry("c"), entry("big", weight=400), budget=250)
    use(p, "a")
    use(p, "b")
    use(p, "c")  # 300 > 250: a, the least recently used, goes
    assert status(p) == {"a": "unloaded", "b": "loaded", "c": "loaded", "big": "unloaded"}
    with pytest.raises(MemoryRefused) as caught:
        use(p, "big")
    assert (caught.value.needed, caught.value.budget) == (400, 250)
    assert status(p)["big"] == "unloaded" and loads.stopped == ["a", "b", "c"]


def test_a_failed_load_is_reported_and_retried() -> None:
    p, loads = pool(entry("a"))
    loads.fail.add("a")
    with pytest.raises(LoadFailed, match="broken weights"):
        use(p, "a")
    model = p.models[0]
    assert model.status is ModelStatus.UNLOADED and model.failure
    assert loads.stopped == ["a"]  # what the failed load started is stopped
    loads.fail.clear()
    use(p, "a")
    assert model.status is ModelStatus.LOADED and model.failure is None


def test_requests_for_a_loading_model_share_its_one_load() -> None:
    p, loads = pool(entry("a"))
    loads.gate.clear()
    model = p.models[0]

    async def scenario() -> None:
        waiters = [asyncio.ensure_future(p.checkout(model, 10)) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert model.status is ModelStatus.LOADING
        assert not any(w.done() for w in waiters)
        loads.gate.set()
        services = await asyncio.gather(*waiters)
        assert len({id(s) for s in services}) == 1 and services[0].in_flight == 5
        for service in services:
            p.release(model, service)

    asyncio.run(scenario())
    assert loads.loaded == ["a"]


def test_a_load_wait_is_bounded() -> None:
    p, loads = pool(entry("a"))
    loads.gate.clear()
    with pytest.raises(TimeoutError):
        asyncio.run(p.checkout(p.models[0], 0.2))
    loads.gate.set()


def test_unload_waits_for_requests_in_flight_up_to_the_stop_timeout() -> None:
    p, loads = pool(entry("a", stop=5), entry("b", stop=0.2))
    a, b = p.models

    async def scenario() -> None:
        service = await p.checkout(a, 10)
        assert p.unload(a) and a.status is ModelStatus.UNLOADED
        await asyncio.sleep(0.2)
        assert loads.stopped == []  # still serving its request
        p.release(a, service)
        held = await p.checkout(b, 10)
        assert p.unload(b)
        await asyncio.sleep(0.6)  # b's stop-timeout passed: stopped with a request in flight
        p.release(b, held)

    asyncio.run(scenario())
    deadline = time.monotonic() + 5
    while sorted(loads.stopped) != ["a", "b"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(loads.stopped) == ["a", "b"]
    assert not p.unload(a)


# ----------------------------------------------------------------------- the directory


def test_models_dir_names_as_llama_server(tmp_path: Path) -> None:
    (tmp_path / "Qwen3-8B-Q4_K_M.gguf").write_bytes(b"GGUF")
    mlx = tmp_path / "my-mlx-model"
    mlx.mkdir()
    (mlx / "config.json").write_text("{}")
    multi = tmp_path / "gemma-3-4b-it-Q8_0"
    multi.mkdir()
    (multi / "gemma-3-4b-it-Q8_0.gguf").write_bytes(b"GGUF")
    (multi / "mmproj-F16.gguf").write_bytes(b"GGUF")
    shards = tmp_path / "Kimi"
    shards.mkdir()
    for i in (2, 1):
        (shards / f"Kimi-0000{i}-of-00002.gguf").write_bytes(b"GGUF")
    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--name" / "refs").mkdir()
    (tmp_path / "models--org--name" / "refs" / "main").write_text("abc")
    (tmp_path / "readme.txt").write_text("x")
    (tmp_path / ".hidden.gguf").write_bytes(b"GGUF")
    (tmp_path / "empty").mkdir()
    # a name that is no UTF-8 would be no JSON model id (GET /models answered 500)
    with open(os.path.join(os.fsencode(tmp_path), b"latin-\xe9.gguf"), "wb") as bad:
        bad.write(b"GGUF")
    warnings: list[str] = []
    found = scan_models_dir(tmp_path, warnings)
    assert warnings == ["--models-dir: skipping 'latin-\ufffd.gguf': its name is not UTF-8"]
    assert found == {
        "Qwen3-8B-Q4_K_M": str(tmp_path / "Qwen3-8B-Q4_K_M.gguf"),
        "my-mlx-model": str(mlx),
        "gemma-3-4b-it-Q8_0": str(multi / "gemma-3-4b-it-Q8_0.gguf"),
        "Kimi": str(shards / "Kimi-00001-of-00002.gguf"),
        "org/name": str(snapshot),
    }


# ----------------------------------------------------------------------- the preset


def test_preset_keys_as_llama_server_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "p.ini"
    path.write_text(
        "version = 1\n"
        "[*]\n"
        "c = 4096\n"
        "port = 9999\n"
        "[one]\n"
        "model = /m/one.gguf\n"
        "ctx-size = 2048\n"
        "no-jinja = true\n"
        "LLAMA_ARG_N_PREDICT = 32\n"
        "temp = 0.5 ; a comment\n"
        "stop-timeout = 3\n"
        "load-on-startup = yes\n"
        "[two]\n"
        "model = /m/two.gguf\n"
        "jinja = false\n"
        "pin = true\n"
    )
    preset = read_preset(path)
    assert preset.defaults.options == {"ctx_size": 4096}
    assert any("port" in line for line in preset.warnings)  # the router owns it
    one, two = preset.sections
    assert one.options == {
        "model": "/m/one.gguf", "ctx_size": 2048, "jinja": False, "n_predict": 32, "temp": 0.5
    }  # fmt: skip
    assert (one.stop_timeout, one.load_on_startup, one.pinned) == (3.0, True, None)
    assert two.options["jinja"] is False and two.pinned is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[a]\nmodel = /x.gguf\nbogus = 1\n", "bogus"),
        ("c = 5\n[a]\nmodel = /x.gguf\n", "before the first section"),
        ("[a]\nmodel = /x.gguf\npin = maybe\n", "pin"),
        ("[a]\nmodel = /x.gguf\nstop-timeout = -1\n", "stop-timeout"),
        ("[a]\nmodel = /x.gguf\nlora = x.gguf\n", "not supported"),
        ("[a\n", "p.ini"),
    ],
)
def test_bad_presets_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.ini"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message) as caught:
        read_preset(path)
    assert "\n" not in str(caught.value)


def test_command_line_wins_over_the_preset(tmp_path: Path, tiny_gguf: Path) -> None:
    path = tmp_path / "p.ini"
    path.write_text(f"[*]\nc = 300\nn = 7\n[t]\nmodel = {tiny_gguf}\nc = 200\nalias = x,y\n")
    base = Settings(models_preset=str(path), ctx_size=999, n_predict=5)
    (only,) = build_catalog(base, cli_fields=["n_predict"]).entries
    assert only.settings.ctx_size == 200  # the section over [*] over the server's value
    assert only.settings.n_predict == 5  # the command line over both
    assert only.settings.alias == "t" and only.aliases == ("x", "y")
    assert only.settings.model == str(tiny_gguf) and only.settings.models_preset is None
    assert only.weight_bytes == tiny_gguf.stat().st_size and only.kind is ModelKind.TEXT


def test_reload_adds_removes_and_unloads_changed_models() -> None:
    p, loads = pool(entry("a"), entry("b"), entry("c"))
    use(p, "a")
    use(p, "b")
    changed = entry("b", weight=999)
    p.reload([entry("a"), changed, entry("d")])
    assert [m.entry.name for m in p.models] == ["a", "b", "d"]
    assert p.find("c") is None and p.find("d") is not None
    assert status(p) == {"a": "loaded", "b": "unloaded", "d": "unloaded"}  # b changed
    deadline = time.monotonic() + 5
    while loads.stopped != ["b"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loads.stopped == ["b"]
    use(p, "b")
    assert p.models[1].entry.weight_bytes == 999 and status(p)["b"] == "loaded"


def real_pool(tiny_llama_dir: Path, tiny_gguf: Path, tmp_path: Path) -> ModelPool:
    """The pool of a directory of two tiny real models, a (MLX) and b (GGUF), at
    --models-max 1."""
    from mlxcel.server.router.serve import model_reader, router_pool

    root = tmp_path / "models"
    root.mkdir()
    (root / "a").symlink_to(tiny_llama_dir)
    (root / "b.gguf").symlink_to(tiny_gguf)
    settings = Settings(models_dir=str(root), models_max=1, ctx_size=256)
    return router_pool(settings, model_reader(settings)())


def test_switching_real_models_stops_their_engines(
    tiny_llama_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    """At --models-max 1 every switch stops and frees the evicted model's engine, and all
    loads share one loader thread: switching leaves no engine or Python thread behind."""
    p = real_pool(tiny_llama_dir, tiny_gguf, tmp_path)
    try:
        use(p, "a")
        before = sorted(t.name for t in threading.enumerate())
        for name in ("b", "a", "b", "a"):
            service = p.models[0].service or p.models[1].service
            assert service is not None and service.state.engine is not None
            gone = weakref.ref(service.state.engine)
            del service
            use(p, name)
            assert sum(m.status is ModelStatus.LOADED for m in p.models) == 1
            # the evicted engine is freed, though loads freeze what they loaded out of the
            # cyclic collector (the engine holds cycles)
            assert gone() is None
        time.sleep(0.2)
        assert sorted(t.name for t in threading.enumerate()) == before
        assert before.count("mlxcel-engine") == 1
    finally:
        p.stop_all()
        gc.unfreeze()


def _native_threads() -> int:
    """This process's threads, MLX's native ones included (Linux /proc)."""
    return len(list(Path("/proc/self/task").iterdir()))


def test_switching_models_leaves_no_native_threads_behind(
    tiny_llama_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    """MLX keeps a thread's streams (native threads) for the life of the process, so each
    engine runs on a pooled thread that the next one reuses: over many switches, evicting
    and explicit unloads alike, the process's thread count stays where it was."""
    from mlxcel.engine import mlx_threads

    p = real_pool(tiny_llama_dir, tiny_gguf, tmp_path)

    def switch(name: str) -> None:
        use(p, name)
        other = p.find("a" if name == "b" else "b")
        assert other is not None and other.service is None

    try:
        for name in ("a", "b", "a"):  # the loader, unloader and engine threads start
            switch(name)
        model = p.find("a")
        assert model is not None and p.unload(model)  # stopped on the unloader thread
        switch("b")
        time.sleep(0.2)
        threads, pooled = _native_threads(), mlx_threads.pooled_threads()
        for name in ("a", "b") * 6:
            switch(name)
        model = p.find("b")
        assert model is not None and p.unload(model)
        switch("a")
        time.sleep(0.2)
        assert _native_threads() <= threads  # a thread per load would add 2 each: 26
        assert mlx_threads.pooled_threads() == pooled
    finally:
        p.stop_all()
        gc.unfreeze()


def test_router_metrics_label_each_loaded_model_and_count_the_pool() -> None:
    """The `--metrics-port` body parses as Prometheus text; a model's name is a label value
    whatever bytes it holds, and the pool's loads, failures and evictions are counted."""
    from prometheus_client.parser import text_string_to_metric_families

    from mlxcel.server.router.metrics import router_metrics_text

    odd = 'we"ird\\name\nx'
    p, loads = pool(entry(odd), entry("b"), entry("broken"), models_max=1)
    loads.fail.add("broken")
    use(p, odd)
    use(p, "b")  # evicts the other
    with pytest.raises(LoadFailed):
        use(p, "broken")  # evicts b, then fails
    use(p, odd)
    samples = {
        (sample.name, sample.labels.get("model")): sample.value
        for family in text_string_to_metric_families(router_metrics_text(p))
        for sample in family.samples
    }
    assert samples["mlxcel_router_model_loaded", odd] == 1
    assert samples["mlxcel_router_model_loaded", "b"] == 0
    assert samples["mlxcel_requests_total", odd] == 0  # the model's own families, labelled
    assert ("mlxcel_requests_total", "b") not in samples
    assert samples["mlxcel_router_loads_total", None] == 3
    assert samples["mlxcel_router_load_failures_total", None] == 1
    assert samples["mlxcel_router_evictions_total", None] == 2
    assert samples["mlxcel_router_models_loaded", None] == 1
    assert samples["mlxcel_router_models", None] == 3


@pytest.mark.parametrize("kind", ["gguf", "mlx"])
def test_a_load_leaves_no_lazy_random_graph_behind(
    kind: str, tiny_llama_dir: Path, tiny_gguf: Path
) -> None:
    """Building a model advances MLX's global random key once per initializer; left lazy,
    that graph kept about 1 MiB per load (a router's RSS grew at every switch). After a
    load the key is a plain evaluated array: its graph is one node, no primitive."""
    import io

    import mlx.core as mx

    from mlxcel.engine.loading import load_model

    for _ in range(2):
        loaded = load_model(str(tiny_gguf if kind == "gguf" else tiny_llama_dir))
        del loaded
        graph = io.StringIO()
        mx.export_to_dot(graph, *mx.random.state)
        assert "shape=rectangle" not in graph.getvalue(), graph.getvalue()[:500]
