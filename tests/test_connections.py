"""The connection guard's arithmetic and bookkeeping (mlxcel.server.connections); the
served behaviour is in tests/reliability/test_slow_connections.py."""

from __future__ import annotations

import asyncio
import errno
import logging

import pytest

from mlxcel.config import Settings
from mlxcel.server.connections import (
    HEAD_SECONDS,
    IDLE_SECONDS,
    ConnectionGuard,
    ConnectionLimits,
    quiet_accept_errors,
)


class Conn:
    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True
        self.guard.release(self)


@pytest.mark.parametrize("files", [1024, 2048, 10240, 1 << 20])
def test_automatic_limits_fit_in_the_file_limit(files: int) -> None:
    limits = ConnectionLimits.sized(file_limit=files)
    assert limits.max_connections == min(4096, files // 2)
    assert limits.ceiling > limits.max_connections
    assert not limits.exceeds(files)


def test_an_explicit_cap_past_the_file_limit_is_flagged() -> None:
    assert ConnectionLimits.sized(5000, file_limit=1024).exceeds(1024)
    assert ConnectionLimits.sized(64, file_limit=1024).max_connections == 64


def test_head_and_idle_bounds_follow_timeout() -> None:
    short = ConnectionLimits.from_settings(Settings(timeout=3, api_prefix="/api"))
    assert (short.head_seconds, short.idle_seconds) == (3, 3)
    assert short.health_paths == {"/health", "/api/health"}
    for timeout in (0, 600):  # off, or longer than the bound: the bound
        limits = ConnectionLimits.from_settings(Settings(timeout=timeout))
        assert (limits.head_seconds, limits.idle_seconds) == (HEAD_SECONDS, IDLE_SECONDS)


def test_admission_overflow_and_dropping_the_oldest() -> None:
    guard = ConnectionGuard(ConnectionLimits(max_connections=2, headroom=2, backlog=16))
    normal = [Conn(guard) for _ in range(2)]
    assert [guard.admit(c) for c in normal] == [True, True]
    overflow = [Conn(guard) for _ in range(2)]
    assert [guard.admit(c) for c in overflow] == [False, False]
    guard.head_received(overflow[1])  # busy answering: never dropped
    newcomer = Conn(guard)
    assert guard.admit(newcomer) is False  # room made by dropping the oldest waiting one
    assert overflow[0].dropped and not overflow[1].dropped
    assert guard.open == 4
    guard.head_received(newcomer)
    assert guard.admit(Conn(guard)) is None  # nothing left to drop: refused
    for conn in (*normal, overflow[1], newcomer):
        guard.release(conn)
    assert guard.open == 0
    assert guard.admit(Conn(guard)) is True


def test_accept_errors_are_one_throttled_line(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop)
        caplog.set_level(logging.WARNING)
        for _ in range(500):
            loop.call_exception_handler(
                {
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(errno.EMFILE, "Too many open files"),
                }
            )
        records = [r for r in caplog.records if "accept" in r.getMessage()]
        assert len(records) == 1
        assert records[0].exc_info is None
        assert "Too many open files" in records[0].getMessage()
        caplog.clear()
        loop.call_exception_handler({"message": "something else"})  # still reported
        assert any("something else" in r.getMessage() for r in caplog.records)
    finally:
        loop.close()
