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

        async def timed_send(message: Message) -> None:
            nonlocal stalled, started
            started = started or message["type"] == "http.response.start"
            try:
                await _within(send(message), seconds)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                stalled = True
                raise ClientStalled(f"the client read nothing for {seconds:g} s") from exc

        failure: BaseException | None = None
        try:
            await self.app(scope, timed_receive, timed_send)
        except Exception as exc:
            if not stalled:
                raise
            failure = exc
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
