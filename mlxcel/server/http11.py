"""uvicorn's h11 protocol, answering malformed or oversized request heads in the OpenAI shape.

h11 rejects a request head larger than its buffer limit (`h11_max_incomplete_event_size`)
before the application sees it; plain uvicorn answers that with a text/plain 400. Here it
gets 431 (Request Header Fields Too Large), and other protocol errors a JSON 400.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxcel.server.errors import error_body

_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}


class GuardedH11Protocol(H11Protocol):
    """H11Protocol whose protocol-level errors use the OpenAI error shape (400 or 431)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._error_status = 400
        original = self.conn.next_event

        def next_event() -> Any:
            try:
                return original()
            except h11.RemoteProtocolError as exc:
                self._error_status = 431 if exc.error_status_hint == 431 else 400
                raise

        self.conn.next_event = next_event  # type: ignore[method-assign]

    def send_400_response(self, msg: str) -> None:
        """Send the error answer for a request h11 could not parse, then close."""
        status = self._error_status
        message = "request headers too large" if status == 431 else "invalid HTTP request"
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
        self.transport.close()
