"""`-to/--timeout`: llama-server's read/write timeout, as ASGI middleware.

llama-server drops a connection whose socket read or write stalls for `--timeout` seconds.
Here: a client that takes longer than that to send the next part of its request body, or
that stops reading the response (a send cannot complete) for that long, is treated as gone:
the request is cancelled as on a disconnect, which frees its slot. Waiting for the answer
is not a read: a long generation is never cut. `--timeout 0` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
            nonlocal stalled
            try:
                await _within(send(message), seconds)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                stalled = True
                raise ClientStalled(f"the client read nothing for {seconds:g} s") from exc

        try:
            await self.app(scope, timed_receive, timed_send)
        except Exception as exc:
            if not stalled:
                raise
            _log_stalled(scope, exc)


def _log_stalled(scope: Scope, exc: BaseException) -> None:
    client: Any = scope.get("client") or ("?", 0)
    log.warning(
        "dropped %s %s from %s: %s (--timeout)",
        scope.get("method", "?"),
        scope.get("path", "?"),
        client[0],
        exc if isinstance(exc, ClientStalled) else "the client stalled",
    )
