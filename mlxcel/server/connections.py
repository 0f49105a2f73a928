"""The connection guard: how long a client may take to send a request head, and how many
connections may be open at once.

A connection that sends nothing is closed after `IDLE_SECONDS` (5 s, cpp-httplib's
keep-alive wait, so llama-server's); one that trickles its request head (slowloris) is
closed once the head has taken `head_seconds` (`HEAD_SECONDS` = 30 s, or `--timeout` when
shorter), counted from the connection or from the end of the previous response.

At most `max_connections` connections are served (`--max-connections`; 0, the default:
half the open-file limit, at most 4096). Past that a connection still gets its answer for
`/health` (so a probe sees the server alive under a connection flood), and any other
request a 503 in the OpenAI error shape; either way the connection then closes, and it has
`OVERFLOW_HEAD_SECONDS` to send its head. The overflow is itself bounded (`headroom`): past
it the oldest overflow connection still waiting for its head is dropped for the newcomer.
With the listen backlog sized from the same limit, the process never runs out of file
descriptors however many connections arrive, and an accept error that happens anyway (other
files) is logged as one line at most every `LOG_EVERY_SECONDS`, never as a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel.server.errors import RETRY_AFTER_SECONDS, scope_error

if TYPE_CHECKING:
    from mlxcel.config import Settings

log = logging.getLogger(__name__)

HEAD_SECONDS = 30.0
"""Longest time a request head may take to arrive (a shorter `--timeout` lowers it)."""
IDLE_SECONDS = 5.0
"""Time a connection may stay without a byte of its next request (uvicorn's keep-alive)."""
OVERFLOW_HEAD_SECONDS = 2.0
"""Head time of a connection past `max_connections`: a health probe sends its head at once."""
AUTO_MAX_CONNECTIONS = 4096
"""The automatic connection cap never exceeds this, whatever the open-file limit."""
MIN_BACKLOG = 128
"""The smallest listen backlog: a burst of clients connecting at once is not made to wait."""
LOG_EVERY_SECONDS = 10.0
"""A repeated connection warning (flood, accept error) is logged at most this often."""
_FALLBACK_FILE_LIMIT = 1024  # where resource.getrlimit is not available


def open_file_limit() -> int:
    """The process's soft limit on open files (RLIMIT_NOFILE)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return _FALLBACK_FILE_LIMIT
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _FALLBACK_FILE_LIMIT if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds one server process applies to its connections (see the module doc)."""

    max_connections: int
    headroom: int  # overflow connections (health answered, others 503) past max_connections
    backlog: int  # the listen backlog: connections accepted in one event-loop pass
    head_seconds: float = HEAD_SECONDS
    idle_seconds: float = IDLE_SECONDS
    health_paths: frozenset[str] = frozenset({"/health"})

    @property
    def ceiling(self) -> int:
        """Open connections past which a newcomer only gets in by dropping an overflow one."""
        return self.max_connections + self.headroom

    @classmethod
    def sized(
        cls, max_connections: int = 0, *, file_limit: int | None = None, **bounds: Any
    ) -> ConnectionLimits:
        """Limits for `max_connections` (0: half the open-file limit, at most 4096): an
        eighth of it as overflow room, a quarter (at least 128, at most 2048) as the listen
        backlog. With the automatic cap and a file limit of 1024 or more, the connections
        never exhaust the file descriptors (`exceeds`)."""
        limit = open_file_limit() if file_limit is None else file_limit
        cap = max_connections or max(16, min(AUTO_MAX_CONNECTIONS, limit // 2))
        backlog = max(MIN_BACKLOG, min(2048, cap // 4))
        return cls(cap, max(8, cap // 8), backlog, **bounds)

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        """`--max-connections`, and the head bound lowered by `--timeout` when set."""
        prefix = (settings.api_prefix or "").strip().strip("/")
        health = {"/health", f"/{prefix}/health"} if prefix else {"/health"}
        head = HEAD_SECONDS if settings.timeout <= 0 else min(HEAD_SECONDS, settings.timeout)
        return cls.sized(
            settings.max_connections,
            head_seconds=float(head),
            idle_seconds=min(IDLE_SECONDS, float(head)),
            health_paths=frozenset(health),
        )

    def exceeds(self, file_limit: int) -> bool:
        """Whether connections (all that are held, plus two backlogs being accepted) may
        use more descriptors than `file_limit` has after an eighth (at least 64) is kept
        for the model, logs and the rest of the process."""
        spare = max(64, file_limit // 8)
        return self.ceiling + 2 * self.backlog > file_limit - spare


class Droppable(Protocol):
    """A connection the guard can drop to make room (a protocol instance)."""

    def drop(self) -> None: ...


class ThrottledWarning:
    """A warning logged at most once per `LOG_EVERY_SECONDS`, with how many were folded in."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._next = 0.0
        self._folded = 0

    def __call__(self, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._folded += 1
            return
        more = f" (+{self._folded} more since the last report)" if self._folded else ""
        log.warning(self.text + more, *args)
        self._next, self._folded = now + LOG_EVERY_SECONDS, 0


class ConnectionGuard:
    """Counts a server process's open connections and decides each newcomer's admission."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self._waiting: dict[Droppable, None] = {}  # overflow connections still without a head
        self._over_cap = ThrottledWarning(
            "connection flood: %d connections open (--max-connections %d); others get 503"
        )
        self._slow_head = ThrottledWarning(
            "closed a connection that sent no complete request head in %g s"
        )

    def admit(self, conn: Droppable) -> bool | None:
        """Count `conn` in. True: served normally; False: overflow (health only, then
        closed); None: no room, `conn` must be closed at once."""
        limits = self.limits
        if self.open >= limits.ceiling:
            if not self._waiting:
                self._over_cap(self.open, limits.max_connections)
                return None
            oldest = next(iter(self._waiting))
            oldest.drop()  # released (counted out) there
        self.open += 1
        if self.open <= limits.max_connections:
            return True
        self._over_cap(self.open, limits.max_connections)
        self._waiting[conn] = None
        return False

    def head_received(self, conn: Droppable) -> None:
        """`conn` sent its request head: no longer a candidate for dropping."""
        self._waiting.pop(conn, None)

    def release(self, conn: Droppable) -> None:
        """`conn`, admitted before, is closed (call once)."""
        self._waiting.pop(conn, None)
        self.open -= 1

    def head_timed_out(self, seconds: float) -> None:
        """A connection is closed for not sending its request head in time."""
        self._slow_head(seconds)

    def over_capacity(self) -> ASGIApp:
        """The 503 a connection past `max_connections` gets for anything but health."""
        message = (
            f"too many open connections (the limit is {self.limits.max_connections}); "
            "try again later"
        )
        headers = {"Retry-After": RETRY_AFTER_SECONDS, "Connection": "close"}

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await scope_error(scope, 503, message, "server_busy", headers)(scope, receive, send)

        return app


class IgnoreClientDisconnect:
    """ASGI wrapper ending quietly a request whose client went away before its body was
    read (a whole request sent and the socket closed at once, a bad chunk size): starlette
    raises ClientDisconnect, which would otherwise be logged as a traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            log.debug("%s %s: the client disconnected", scope.get("method"), scope.get("path"))


_ACCEPT_FAILED = "socket.accept() out of system resource"


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log asyncio's accept failures (out of file descriptors) as one throttled line each
    instead of a traceback per attempt; every other loop error goes to the usual handler."""
    warn = ThrottledWarning("cannot accept connections: %s")
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_FAILED:
            exc = context.get("exception")
            warn(getattr(exc, "strerror", None) or exc or "out of system resources")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
