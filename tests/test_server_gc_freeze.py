"""A served model's objects leave the cyclic garbage collector once loaded.

A full collection walks every tracked object while holding the GIL: with MLX, mlx-lm and a
vision processor imported that took 30-70 ms, often on the event loop. The server freezes
what is alive after loading (`gc.freeze()`), so later full passes walk only what requests
allocate."""

from __future__ import annotations

import gc

import pytest

from mlxcel.config.settings import Settings
from mlxcel.server import runner
from mlxcel.server.state import ServerState


def _serving(calls: list[str], failure: Exception | None = None) -> runner.Serving:
    def loaded() -> None:
        calls.append("load")
        if failure is not None:
            raise failure

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("not served in this test")

    return runner.Serving(
        state=ServerState(settings=Settings(model="unused")),
        app=app,
        load=loaded,
        announce=lambda: calls.append("announce"),
        busy=lambda: False,
        stop=lambda: None,
    )


def test_the_loaded_models_are_frozen_before_the_server_announces_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    runner._Server(_serving(calls), [])._load()
    assert calls == ["load", "freeze", "announce"]


def test_a_failed_load_freezes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    server = runner._Server(_serving(calls, RuntimeError("no such model")), [])
    server._load()
    assert calls == ["load"] and server.failure == "no such model"
