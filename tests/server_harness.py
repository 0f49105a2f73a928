"""Start `mlxcel serve` for tests: a real subprocess, or uvicorn in a thread of this process.

Both bind 127.0.0.1 on an ephemeral port, wait until `/health` answers 200 and always stop:
the subprocess gets SIGTERM then SIGKILL, dies with the test process (Linux parent-death
signal) and is killed at interpreter exit at the latest; the in-process server stops its
uvicorn loop and engine thread.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def main_server_args(model_dir: Path) -> list[str]:
    """The server configuration the server test modules share (one process for all)."""
    return [
        "-m", str(model_dir), "-np", "4", "-c", "4096", "--api-key", API_KEY, "--metrics",
        "--max-body-size", "65536",
    ]  # fmt: skip


LISTENING = re.compile(r"mlxcel: listening on (https?://\S+)")
START_TIMEOUT = 120.0

_live: set[subprocess.Popen[bytes]] = set()


def _kill_leftovers() -> None:
    for proc in list(_live):
        with contextlib.suppress(OSError):
            proc.kill()


atexit.register(_kill_leftovers)


def _die_with_parent(rlimits: Mapping[int, tuple[int, int]] | None = None) -> None:
    """Runs in the child between fork and exec: `rlimits` applied, SIGTERM at parent death."""
    import resource

    for which, limits in (rlimits or {}).items():
        resource.setrlimit(which, limits)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServeProcess:
    """`mlxcel serve ARGS --host 127.0.0.1 --port 0` as a subprocess (a context manager)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        add_address: bool = True,
        cwd: str | Path | None = None,
        health_path: str = "/health",
        rlimits: Mapping[int, tuple[int, int]] | None = None,
    ) -> None:
        """`rlimits`: resource limits (`resource.RLIMIT_*` -> (soft, hard)) the server starts
        under."""
        self.args = list(args)
        self.rlimits = dict(rlimits or {})
        if add_address:
            self.args += ["--host", "127.0.0.1", "--port", "0"]
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.health_path = health_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._lines: list[str] = []
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    def start(self, timeout: float = START_TIMEOUT) -> ServeProcess:
        """Start the server and wait until `/health` answers 200."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.cwd,
            preexec_fn=functools.partial(_die_with_parent, self.rlimits),
        )
        _live.add(self.proc)
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._lines.append(line)
            match = LISTENING.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._listening.set()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.05):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlxcel serve exited early:\n{self.stderr}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlxcel serve did not bind in {timeout}s:\n{self.stderr}")
        wait_healthy(
            self.url,
            deadline,
            alive=lambda: self.proc is not None and self.proc.poll() is None,
            path=self.health_path,
        )

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        _live.discard(proc)
        if self._reader is not None:
            self._reader.join(2)
        return proc.returncode

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the process to end on its own; its exit status."""
        assert self.proc is not None
        code = self.proc.wait(timeout)
        _live.discard(self.proc)
        if self._reader is not None:
            self._reader.join(2)
        return code

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------- helpers

    @property
    def stderr(self) -> str:
        """Everything the server wrote on stderr so far."""
        return "\n".join(self._lines)

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client on this server."""
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)


def wait_healthy(
    url: str, deadline: float, alive: Any = lambda: True, *, path: str = "/health"
) -> None:  # TLS servers in tests use self-signed certificates: no verification
    """Poll `url` + `path` until 200 (the model is loaded) or `deadline` passes."""
    last = ""
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server at {url} died while loading ({last})")
        try:
            response = httpx.get(f"{url}{path}", timeout=5, verify=False)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.TransportError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise RuntimeError(f"server at {url} not healthy in time ({last})")


class InProcessServer:
    """The same application under a real uvicorn, in a thread of the test process.

    Cheaper than a subprocess when a test needs another configuration of an already
    loaded model: pass `loaded` state fields or let it load `settings.model` itself.
    """

    def __init__(self, settings: Any, *, state: Any = None) -> None:
        from mlxcel.server.state import ServerState

        self.settings = settings
        self.state = state if state is not None else ServerState(settings=settings)
        self.url = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = START_TIMEOUT) -> InProcessServer:
        import uvicorn

        from mlxcel.server.app import create_app
        from mlxcel.server.boot import load_into
        from mlxcel.server.runner import uvicorn_config

        if self.state.client is None:
            load_into(self.state)
        settings = self.settings.model_copy(update={"host": "127.0.0.1", "port": 0})
        self._server = uvicorn.Server(uvicorn_config(create_app(self.state), settings))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        scheme = "https" if self.settings.ssl_cert_file else "http"
        self.url = f"{scheme}://127.0.0.1:{port}"
        from mlxcel.server.app import normalize_prefix

        prefix = normalize_prefix(self.settings.api_prefix)
        wait_healthy(self.url, deadline, path=f"{prefix}/health")
        return self

    def stop(self, *, stop_engine: bool = True) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        engine = self.state.engine
        if stop_engine and engine is not None:
            engine.stop()

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client on this server (certificates not verified)."""
        kwargs.setdefault("verify", False)
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60.0), **kwargs)


@contextlib.contextmanager
def serve(args: Sequence[str], **kwargs: Any) -> Iterator[ServeProcess]:
    """`with serve([...]) as server:` a started ServeProcess, always stopped afterwards."""
    server = ServeProcess(args, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


_shared: dict[tuple[str, ...], ServeProcess] = {}


def shared_server(args: Sequence[str]) -> ServeProcess:
    """One started server per argument list for the whole test session (stopped at exit)."""
    key = tuple(args)
    server = _shared.get(key)
    if server is None or server.proc is None or server.proc.poll() is not None:
        server = ServeProcess(args).start()
        _shared[key] = server
    return server


def _stop_shared() -> None:
    for server in _shared.values():
        server.stop()


atexit.register(_stop_shared)
