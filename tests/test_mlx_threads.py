"""The pooled threads engines and workers run on (`mlxcel/engine/mlx_threads.py`)."""

from __future__ import annotations

import threading

import pytest

from mlxcel.engine.mlx_threads import pooled_threads, run_pooled


def test_a_finished_run_hands_its_thread_and_mlx_streams_to_the_next() -> None:
    import mlx.core as mx

    seen: list[tuple[int, str, float]] = []

    def work() -> None:
        me = threading.current_thread()
        seen.append((me.ident or 0, me.name, mx.sum(mx.ones((4, 4))).item()))

    first = run_pooled(work, "first-loop")
    first.join(10)
    assert not first.is_alive()
    count = pooled_threads()
    second = run_pooled(work, "second-loop")
    second.join(10)
    assert pooled_threads() == count  # reused, not a new thread
    assert seen[0][0] == seen[1][0]
    assert [name for _, name, _ in seen] == ["first-loop", "second-loop"]
    assert [total for _, _, total in seen] == [16.0, 16.0]  # its MLX streams still work


def test_busy_threads_are_not_shared_and_a_failing_run_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_value))
    gate = threading.Event()
    holding = threading.Event()
    idents: list[int] = []

    def held() -> None:
        idents.append(threading.get_ident())
        holding.set()
        gate.wait(10)

    def fails() -> None:
        idents.append(threading.get_ident())
        raise RuntimeError("broken loop")

    busy = run_pooled(held, "held")
    assert holding.wait(10)  # idents[0] is the held loop's thread (not a race with `fails`)
    failing = run_pooled(fails, "fails")
    failing.join(10)
    assert not failing.is_alive() and busy.is_alive()
    assert idents[0] != idents[1]  # the held thread was not handed a second loop
    assert [str(exc) for exc in reported] == ["broken loop"]
    gate.set()
    busy.join(10)
    assert not busy.is_alive()
    again = run_pooled(lambda: idents.append(threading.get_ident()), "again")
    again.join(10)
    assert idents[2] in idents[:2]  # the failed run's thread, or the other, is reused
