"""uvicorn's h11 protocol with mlxcel's connection guard and OpenAI-shaped protocol errors.

h11 rejects a request head larger than its buffer limit (`h11_max_incomplete_event_size`)
before the application sees it; plain uvicorn answers that with a text/plain 400. Here it
gets 431 (Request Header Fields Too Large), and other protocol errors a JSON 400. The answer
is followed by a half-close and a bounded drain of what the client still sends: closing a
socket with unread data resets the connection, and the client then loses the answer.

Each connection also follows `mlxcel.server.connections`: it is closed when it sends
nothing for `idle_seconds` or takes longer than `head_seconds` to send a request head
(uvicorn bounds neither for a new connection), and past `max_connections` it is answered
`/health` or a 503, then closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxcel.server.connections import OVERFLOW_HEAD_SECONDS, ConnectionGuard
from mlxcel.server.errors import error_body

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}
DRAIN_BYTES = 16 * 1024 * 1024  # read and dropped after a protocol error's answer, at most
DRAIN_SECONDS = 5.0  # how long the client has to stop sending after that answer


def _framed_twice(request: h11.Request) -> bool:
    """Whether `request` gives both a Content-Length and a Transfer-Encoding: a proxy and
    this server could then disagree on where its body ends (request smuggling), so it is
    refused and the connection closed (RFC 9112 6.1 requires the close at least)."""
    names = {name for name, _ in request.headers}
    return b"content-length" in names and b"transfer-encoding" in names


class GuardedH11Protocol(H11Protocol):
    """H11Protocol under a ConnectionGuard, its protocol errors in the OpenAI error shape.

    Built for one guard by `guarded_protocol` (uvicorn instantiates the class itself).
    """

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error_status = 400
        self._head_timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self._overflow = False
        self._drain_left = -1  # bytes still to drop after a protocol error; -1: not draining
        self._drain_timer: asyncio.TimerHandle | None = None
        original = self.conn.next_event

        def next_event() -> Any:
            try:
                event = original()
            except h11.RemoteProtocolError as exc:
                self._error_status = 431 if exc.error_status_hint == 431 else 400
                raise
            if isinstance(event, h11.Request):
                if _framed_twice(event):
                    self._error_status = 400
                    raise h11.RemoteProtocolError(
                        "both Content-Length and Transfer-Encoding", error_status_hint=400
                    )
                if self._overflow:
                    self.guard.head_received(self)
            return event

        self.conn.next_event = next_event  # type: ignore[method-assign]

    # ----------------------------------------------------------------- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        admitted = self.guard.admit(self)
        if admitted is None:  # no room even past the cap: close before reading anything
            transport.close()
            return
        self._admitted = True
        if not admitted:
            self._overflow = True
            self.app = self._overflow_app(self.app)
        # uvicorn arms its idle (keep-alive) timer only after a response: arm it for the
        # first request too, so that a connection that never sends a byte is closed.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_head_timer()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._release()

    def data_received(self, data: bytes) -> None:
        if self._drain_left < 0:
            super().data_received(data)
            return
        self._drain_left -= len(data)
        if self._drain_left < 0:
            self.transport.close()

    def drop(self) -> None:
        """Close this connection to make room for a newer one (the guard's choice)."""
        self._release()
        self._cancel_head_timer()
        self.transport.close()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """Hand the connection to the WebSocket protocol (`/v1/realtime`); its slot in the
        guard is released when that protocol's connection ends."""
        self._cancel_head_timer()
        super().handle_websocket_upgrade(event)
        protocol = self.transport.get_protocol()
        lost = protocol.connection_lost

        def connection_lost(exc: Exception | None) -> None:
            lost(exc)
            self._release()

        protocol.connection_lost = connection_lost  # type: ignore[method-assign]

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self)

    # ------------------------------------------------------------ request heads

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def _watch_head(self) -> None:
        """Time the request head while one is awaited (from the connection or the end of
        the previous response until the head is complete); stop timing once it is."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            seconds = self.guard.limits.head_seconds
            if self._overflow:
                seconds = min(seconds, OVERFLOW_HEAD_SECONDS)
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out, seconds)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self, seconds: float) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came (slowloris), not just silence
            self.guard.head_timed_out(seconds)
        self.transport.close()

    # --------------------------------------------------------------- overflow

    def _overflow_app(self, app: ASGIApp) -> ASGIApp:
        """Past the connection cap: health through `app` and the 503 otherwise, each
        closing the connection after the answer."""
        health_paths = self.guard.limits.health_paths
        refuse = self.guard.over_capacity()

        async def overflow(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("path") not in health_paths:
                await refuse(scope, receive, send)
                return

            async def closing_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (b"connection", b"close")]
                    message = {**message, "headers": headers}
                await send(message)

            await app(scope, receive, closing_send)

        return overflow

    # ----------------------------------------------------------- protocol errors

    def send_400_response(self, msg: str) -> None:
        """Send the error answer for a request h11 could not parse, then close after a drain."""
        status = self._error_status
        message = "invalid HTTP request"
        if status == 431:
            limit = self.config.h11_max_incomplete_event_size
            message = "request headers too large" + (
                f": the limit is {limit} bytes" if limit else ""
            )
        body = json.dumps(error_body(message, "invalid_request_error")).encode("utf-8")
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
        ]
        try:
            self.transport.write(
                self.conn.send(
                    h11.Response(status_code=status, headers=headers, reason=_REASONS[status])
                )
                or b""
            )
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:
            pass  # a response was already under way: just close
        self._close_after_drain()

    def _close_after_drain(self) -> None:
        """Half-close, then drop what the client still sends (up to `DRAIN_BYTES`, for up
        to `DRAIN_SECONDS`) and close: the client reads the answer before the close."""
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._drain_left = DRAIN_BYTES
        self._drain_timer = self.loop.call_later(DRAIN_SECONDS, self.transport.close)


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to `guard`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
