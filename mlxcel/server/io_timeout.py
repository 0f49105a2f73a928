"""`-to/--timeout`: llama-server's read/write timeout, as ASGI middleware.

llama-server drops a connection whose socket read or write stalls for `--timeout` seconds.
Here: a client that takes longer than that to send the next part of its request body, or
that stops reading the response (a send cannot complete) for that long, is treated as gone:
the request is cancelled as on a disconnect, which frees its slot; a stalled request body
gets a 408 in the API's error shape. Waiting for the answer is not a read: a long generation
is never cut. `--timeout 0` turns it off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxcel.server.errors import scope_error

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):  # no extra task per call
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class ClientStalled(ConnectionError):
    """The client neither sent nor read anything for `--timeout` seconds."""


class _SendWatch:
    """Cancels a response write that has waited `seconds` for the client to read.

    A write the socket takes at once (nearly every SSE chunk of a client that keeps
    reading) costs two attribute stores; one timer per response, armed by the first write
    and re-armed at most once per `seconds`, checks the write in progress, where a timeout
    context per write cost a timer handle each.
    """

    __slots__ = ("_loop", "_seconds", "_task", "_since", "_timer", "fired")

    def __init__(self, seconds: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._seconds = seconds
        self._task: asyncio.Task[Any] | None = None  # the task whose write is waiting
        self._since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.fired = False

    def begin(self) -> asyncio.Task[Any] | None:
        """A write starts in the current task; returns that task."""
        task = asyncio.current_task()
        self._task, self._since = task, self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._seconds, self._check)
        return task

    def end(self) -> None:
        """The write finished (or failed)."""
        self._task = None

    def close(self) -> None:
        """The response is over: no more checks."""
        self._task = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        task = self._task
        if task is None:  # no write waiting: the next write arms the timer again
            return
        due = self._since + self._seconds
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._check)
            return
        self.fired = True
        task.cancel()


class IoTimeout:
    """ASGI middleware applying `--timeout` to request-body reads and response writes."""

    def __init__(self, app: ASGIApp, *, seconds: float) -> None:
        self.app = app
        self.seconds = float(seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.seconds <= 0:
            await self.app(scope, receive, send)
            return
        seconds = self.seconds
        body_done = False
        stalled = False
        started = False  # the response head went out

        async def timed_receive() -> Message:
            nonlocal body_done, stalled
            if body_done:  # waiting for a disconnect while the answer is generated
                return await receive()
            try:
                message = await _within(receive(), seconds)
            except (TimeoutError, asyncio.TimeoutError):  # the same class from 3.11
                stalled = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        watch = _SendWatch(seconds)

        async def timed_send(message: Message) -> None:
            nonlocal stalled, started
            started = started or message["type"] == "http.response.start"
            task = watch.begin()
            try:
                await send(message)
            except asyncio.CancelledError:
                if not watch.fired:
                    raise
                stalled = True
                uncancel = getattr(task, "uncancel", None)  # Python 3.11+
                if uncancel is not None:
                    uncancel()
                raise ClientStalled(f"the client read nothing for {seconds:g} s") from None
            finally:
                watch.end()

        failure: BaseException | None = None
        try:
            await self.app(scope, timed_receive, timed_send)
        except Exception as exc:
            if not stalled:
                raise
            failure = exc
        finally:
            watch.close()
        if not stalled:
            return
        _log_stalled(scope, failure)
        if not started:  # the body stalled: answer instead of leaving the server to 500
            message = f"request timed out: the client sent nothing for {seconds:g} s"
            with contextlib.suppress(Exception):
                await scope_error(scope, 408, message, "invalid_request_error")(
                    scope, receive, timed_send
                )


def _log_stalled(scope: Scope, exc: BaseException | None) -> None:
    client: Any = scope.get("client") or ("?", 0)
    log.warning(
        "dropped %s %s from %s: %s (--timeout)",
        scope.get("method", "?"),
        scope.get("path", "?"),
        client[0],
        exc if isinstance(exc, ClientStalled) else "the client stalled",
    )
