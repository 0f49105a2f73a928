"""Run `mlxcel serve`: bind the HTTP port, load the models, serve until told to stop.

The port opens first and answers `/health` with "loading model" (503) while the models
load on a background thread (`mlxcel.server.boot`), as llama-server does; the other routes
answer 503 until then. This module is the HTTP lifecycle: uvicorn, the listening sockets,
the stop signals and draining. What it serves is a `Serving`: one model's (`single_model`)
or, in router mode, several models' (`mlxcel.server.router.serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp

from mlxcel.server.app import create_app
from mlxcel.server.boot import announce, check_settings, load_into, stop_services
from mlxcel.server.connections import (
    ConnectionGuard,
    ConnectionLimits,
    IgnoreClientDisconnect,
    open_file_limit,
    quiet_accept_errors,
)
from mlxcel.server.distributed import check_distributed, join_ranks, run_follower
from mlxcel.server.health import is_draining, set_draining
from mlxcel.server.http11 import guarded_protocol
from mlxcel.server.middleware import MAX_HEADER_BYTES
from mlxcel.server.ops.routes import metrics_app
from mlxcel.server.state import ServerState

if TYPE_CHECKING:
    from mlxcel.config import Settings

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_SECONDS = 3
DRAIN_SECONDS = 30.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LISTENING_PREFIX = "mlxcel: listening on "


def check_ssl(settings: Settings) -> None:
    """`--ssl-key-file` needs `--ssl-cert-file`, both must be readable files, and they must
    load as a certificate and its key (uvicorn, failing on them later, exits 1 silently)."""
    from mlxcel.config import SettingsError

    key, cert = settings.ssl_key_file, settings.ssl_cert_file
    if key and not cert:
        raise SettingsError("--ssl-key-file needs --ssl-cert-file")
    for label, value in (("--ssl-cert-file", cert), ("--ssl-key-file", key)):
        if value and not Path(value).expanduser().is_file():
            raise SettingsError(f"{label}: file not found: {value}")
    if cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # no passphrase prompt: uvicorn is given none either
            context.load_cert_chain(
                Path(cert).expanduser(), Path(key).expanduser() if key else None, lambda: b""
            )
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
            raise SettingsError(
                f"--ssl-cert-file/--ssl-key-file: not a PEM certificate and its key ({reason})"
            ) from None


def _log_level(settings: Settings) -> str:
    if settings.log_disable:
        return "critical"
    if settings.verbose:
        return "debug"
    return "info" if settings.log_verbosity > 3 else "warning"


def uvicorn_config(
    app: Any,
    settings: Settings,
    *,
    port: int | None = None,
    guard: ConnectionGuard | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration for `app` (h11 with the header cap and the connection
    guard, SSL when given); servers of one process share one `guard` (one file limit)."""
    if guard is None:
        guard = ConnectionGuard(ConnectionLimits.from_settings(settings))
    limits = guard.limits
    return uvicorn.Config(
        IgnoreClientDisconnect(app),
        host=settings.host,
        port=settings.port if port is None else port,
        http=guarded_protocol(guard),
        backlog=limits.backlog,
        timeout_keep_alive=limits.idle_seconds,  # type: ignore[arg-type]
        ws="wsproto",  # /v1/realtime (the only WebSocket route)
        lifespan="off",
        log_level=_log_level(settings),
        access_log=settings.verbose,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        ssl_keyfile=settings.ssl_key_file,
        ssl_certfile=settings.ssl_cert_file,
        server_header=False,
    )


def connection_guard(settings: Settings) -> ConnectionGuard:
    """The connection guard for this process, warning when `--max-connections` asks for
    more than the open-file limit can hold."""
    limits = ConnectionLimits.from_settings(settings)
    files = open_file_limit()
    if settings.max_connections and limits.exceeds(files):
        print(
            f"mlxcel: warning: --max-connections {limits.max_connections} is more than the "
            f"open-file limit ({files}) can hold; raise it (ulimit -n) or lower the cap",
            file=sys.stderr,
            flush=True,
        )
    return ConnectionGuard(limits)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket for `host:port` (port 0: any free one); OSError when it cannot bind."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket, settings: Settings) -> str:
    port = sock.getsockname()[1]
    scheme = "https" if settings.ssl_cert_file else "http"
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class Serving:
    """What the HTTP lifecycle serves: the app, and how its models load, report, stop."""

    state: ServerState  # the server's: `/health` and draining are keyed on it
    app: ASGIApp
    load: Callable[[], None]  # on the loading thread, once listening; raises to stop
    announce: Callable[[], None]  # after a load that worked
    busy: Callable[[], bool]  # a request is in flight (SIGTERM drains first)
    stop: Callable[[], None]
    metrics: ASGIApp | None = None  # the `--metrics-port` app


def single_model(state: ServerState) -> Serving:
    """Serving one model (or its side models): today's `mlxcel serve -m`."""
    return Serving(
        state=state,
        app=create_app(state),
        load=partial(load_into, state),
        announce=partial(announce, state),
        busy=partial(_busy, state),
        stop=partial(stop_services, state),
        metrics=metrics_app(state),
    )


class _Server:
    """The main uvicorn server plus, with `--metrics-port`, a metrics-only one."""

    def __init__(self, serving: Serving, sockets: list[socket.socket]) -> None:
        self.serving = serving
        self.state = serving.state
        self.sockets = sockets
        settings = self.state.settings
        guard = connection_guard(settings)
        self.main = _MainServer(uvicorn_config(serving.app, settings, guard=guard))
        self.main.serving = serving
        self.metrics: uvicorn.Server | None = None
        if len(sockets) > 1 and serving.metrics is not None:
            config = uvicorn_config(
                serving.metrics, settings, port=settings.metrics_port, guard=guard
            )
            self.metrics = _QuietServer(config)
        self.failure: str | None = None

    def _load(self) -> None:
        try:
            self.serving.load()
        except Exception as exc:  # noqa: BLE001 - reported as one line, then the server stops
            from mlxcel.server.openai_common import scrub_paths

            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.failure = text if _is_user_error(exc) else scrub_paths(text)
            self.main.should_exit = True
            if self.metrics is not None:
                self.metrics.should_exit = True
            return
        # What is loaded now lives as long as the server: out of the cyclic collector's
        # full passes, which walk every tracked object holding the GIL (tens of ms once MLX
        # and the processors are imported, on whichever thread allocates: often the loop).
        gc.freeze()
        self.serving.announce()

    async def serve(self) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        main = self.main
        tasks = [asyncio.ensure_future(main.serve(sockets=self.sockets[:1]))]
        if self.metrics is not None:
            tasks.append(asyncio.ensure_future(self.metrics.serve(sockets=self.sockets[1:2])))
        while not main.started and not tasks[0].done():
            await asyncio.sleep(0.02)
        if main.started:
            url = _url(self.sockets[0], self.state.settings)
            print(LISTENING_PREFIX + url, file=sys.stderr, flush=True)
            threading.Thread(target=self._load, name="mlxcel-load", daemon=True).start()
        await asyncio.gather(tasks[0], return_exceptions=True)
        if self.metrics is not None:
            self.metrics.should_exit = True
            await asyncio.gather(tasks[1], return_exceptions=True)


class _MainServer(uvicorn.Server):
    """uvicorn's server, ending with status 0 after SIGINT/SIGTERM (no re-raised signal).

    The first signal drains: while requests are queued or running, `/health` answers 503
    "draining" (a load balancer stops sending), the port stays open and the in-flight
    requests finish (at most DRAIN_SECONDS), then the server stops. A second signal stops
    it at once.
    """

    serving: Serving | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        serving = self.serving
        if serving is not None and is_draining(serving.state):  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        if self.should_exit or serving is None or not serving.busy():
            super().handle_exit(sig, frame)
            return
        set_draining(serving.state)
        print("mlxcel: draining: finishing in-flight requests", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="mlxcel-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline and self.serving is not None and self.serving.busy():
            time.sleep(0.05)
        time.sleep(0.2)  # the last events reach their clients
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _busy(state: ServerState) -> bool:
    """Whether the text engine has a request queued or holding a slot."""
    engine = state.engine
    if engine is None:
        return False
    snap = engine.snapshot()
    return bool(snap.queued) or any(slot.state != "idle" for slot in snap.slots)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the main one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _is_user_error(exc: BaseException) -> bool:
    from mlxcel.config import SettingsError
    from mlxcel.engine.errors import ModelLoadError

    return isinstance(exc, (ModelLoadError, SettingsError))


def _bind_all(settings: Settings) -> list[socket.socket]:
    """The main socket and, with a distinct `--metrics-port`, the metrics one."""
    ports = [settings.port]
    if settings.metrics_port is not None and settings.metrics_port != settings.port:
        ports.append(settings.metrics_port)
    sockets: list[socket.socket] = []
    for port in ports:
        try:
            sockets.append(listen_socket(settings.host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            reason = exc.strerror or str(exc)
            raise OSError(f"cannot listen on {settings.host}:{port}: {reason}") from None
    return sockets


def run_server(settings: Settings, cli_fields: Collection[str] = ()) -> int:
    """Serve until SIGINT/SIGTERM; the exit status (1: cannot listen, 2: cannot load).

    `cli_fields`: the settings given on the command line (in router mode they win over a
    model's preset options)."""
    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.server.router.catalog import router_wanted

    check_ssl(settings)
    router = router_wanted(settings)
    ranks = None
    try:
        ranks = join_ranks(settings)
        if ranks is not None:  # one rank of a group started by mlx.launch
            check_distributed(settings)
        if router:  # never announce a port that then disappears
            from mlxcel.server.router.serve import router_serving

            serving = router_serving(settings, cli_fields)
        else:
            check_settings(settings)
    except ModelLoadError as exc:
        print(f"mlxcel: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if ranks is not None and not ranks.leader:
        return run_follower(settings, ranks)
    try:
        sockets = _bind_all(settings)
    except OSError as exc:
        print(f"mlxcel: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if not router:
        serving = single_model(ServerState(settings=settings, ranks=ranks))
    server = _Server(serving, sockets)
    try:
        asyncio.run(server.serve())
    finally:
        serving.stop()
    if server.failure is not None:
        print(f"mlxcel: error: {server.failure}", file=sys.stderr, flush=True)
        return 2
    if not server.main.started:
        return 1
    return 0
