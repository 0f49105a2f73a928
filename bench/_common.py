"""Shared pieces of the serving benchmarks: the benchmark model, servers, a streaming client.

Servers (`mlxcel serve`, `mlx_lm.server`) run as subprocesses bound to 127.0.0.1 on a free
port; they die with this process (Linux parent-death signal), are stopped on exit of their
`with` block, and are killed at interpreter exit at the latest. All traffic stays local.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = Path(tempfile.gettempdir()) / "mlxcel-bench"

# A ~20M-parameter float32 llama (the size the mlx_lm.server figures were taken on).
BENCH_DIMS: dict[str, int] = {
    "hidden_size": 512,
    "num_layers": 6,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1536,
}

# Eight different user prompts, one per concurrent client.
PROMPTS = (
    "Tell me about the morning train and the station.",
    "What is the capital of France, and of Italy?",
    "Count the boxes: 12, 24, 36, 48. How many are there?",
    "Where are you going before the market closes?",
    "Describe the river that runs north to the sea.",
    "Why is good software tested, measured and explained?",
    "How many eggs and cups of flour does the recipe need?",
    "What did the children play in the garden?",
)

_live: set[subprocess.Popen[bytes]] = set()


def _kill_leftovers() -> None:
    for proc in list(_live):
        with contextlib.suppress(OSError):
            proc.kill()


atexit.register(_kill_leftovers)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------- model


def bench_model(out_dir: Path | None = None, dims: dict[str, int] | None = None) -> Path:
    """The benchmark model: an fp32 llama MLX dir built with the test fixture (cached)."""
    dims = dims or BENCH_DIMS
    tag = "-".join(f"{v}" for v in dims.values())
    out_dir = out_dir or BENCH_DIR / f"llama-{tag}"
    if not (out_dir / "generation_config.json").is_file():  # the last file the builder writes
        sys.path.insert(0, str(ROOT / "tests"))
        from fixtures.tiny_models import build_tiny_model

        build_tiny_model(out_dir, "llama", **dims)
    return out_dir


def param_count(model_dir: Path) -> int:
    """Number of parameters in an MLX dir's safetensors files (read from their headers)."""
    import math
    import struct

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def eos_bias(model_dir: Path) -> dict[str, float]:
    """`logit_bias` that keeps a random-weight model from ending early (both servers take it)."""
    config = json.loads((model_dir / "generation_config.json").read_text())
    ids = config.get("eos_token_id", [])
    ids = ids if isinstance(ids, list) else [ids]
    return {str(i): -100.0 for i in ids}


# -------------------------------------------------------------------------------- servers


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server subprocess on 127.0.0.1; a context manager that always stops it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        health: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {})}
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health = health
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: list[str] = []

    def start(self, timeout: float = 180.0) -> Server:
        """Start and wait until the health route answers 200."""
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=self.env,
            preexec_fn=_die_with_parent,
        )
        _live.add(self.proc)
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n" + "\n".join(self._log[-20:]))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout}s")

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            self._log.append(raw.decode("utf-8", "replace").rstrip())
            del self._log[:-200]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        _live.discard(proc)
        self.proc = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def mlxcel_server(model: str | Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    """`mlxcel serve -m MODEL` on a free port (warm-up on, no API key); `env`: variables
    added to its environment."""
    port = free_port()
    argv = [sys.executable, "-m", "mlxcel", "serve", "-m", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), *extra]
    return Server("mlxcel serve", argv, port, "/health", env=env)


def mlx_lm_server(model: str | Path, *extra: str, blas: str | None = None) -> Server:
    """`python -m mlx_lm server --model MODEL` on a free port; `blas`: a BLAS library to
    LD_PRELOAD (MLX's Linux wheel otherwise runs its bundled reference BLAS)."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *extra]
    env = {"LD_PRELOAD": blas} if blas else None
    name = "mlx_lm.server" + (" + OpenBLAS" if blas else "")
    return Server(name, argv, port, "/health", env)


def system_openblas() -> str | None:
    """Path of the system OpenBLAS that `mlxcel.engine` loads under MLX, if there is one."""
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    for name in ("openblas", "openblasp", "openblas64_"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


# --------------------------------------------------------------------------------- client


@dataclass
class StreamResult:
    """One streamed request: times are `time.perf_counter()` seconds."""

    sent: float
    first: float  # first content chunk (the finishing chunk when there was no content)
    last: float  # last content chunk
    tokens: int  # completion tokens (usage), else content chunks
    text: str

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def decode_rate(self) -> float:
        """Tokens after the first, per second between the first and the last."""
        span = self.last - self.first
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else 0.0


class _ChunkTally:
    """What a stream's chunks tell: content pieces and when they came, and the usage."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first = self.last = 0.0
        self.chunks = self.usage_tokens = 0
        self.pieces: list[str] = []

    def feed(self, chunk: dict[str, Any]) -> None:
        """Count one parsed SSE chunk (chat or completions)."""
        if chunk.get("usage"):
            self.usage_tokens = int(chunk["usage"].get("completion_tokens") or 0)
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if piece:
                now = time.perf_counter()
                self.first = self.first or now
                self.last = now
                self.chunks += 1
                self.pieces.append(piece)
            elif choice.get("finish_reason") and not self.first:  # no text: time the end
                self.first = self.last = time.perf_counter()

    def result(self) -> StreamResult:
        sent = self.sent
        tokens = self.usage_tokens or self.chunks
        return StreamResult(
            sent, self.first or sent, self.last or sent, tokens, "".join(self.pieces)
        )


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, route: str = "chat"
) -> StreamResult:
    """POST a streaming chat (or completions) request and time its chunks."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    tally = _ChunkTally(time.perf_counter())
    async with client.stream("POST", url + path, json=payload) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}{path}: {response.status_code} {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tally.feed(json.loads(line[6:]))
    return tally.result()


class _SseReader:
    """The events of one streamed HTTP/1.1 response read straight off its socket: the body
    chunked or ended by the server closing the connection, split into SSE events."""

    def __init__(self, reader: asyncio.StreamReader, chunked: bool) -> None:
        self._reader = reader
        self._chunked = chunked
        self._buffer = b""
        self._body_done = False

    async def _more(self) -> bool:
        if self._body_done:
            return False
        if not self._chunked:
            data = await self._reader.read(65536)
            if not data:
                self._body_done = True
                return False
            self._buffer += data
            return True
        size_line = await self._reader.readline()
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            self._body_done = True
            return False
        self._buffer += await self._reader.readexactly(size)
        await self._reader.readexactly(2)  # the CRLF after the chunk
        return True

    async def events(self) -> AsyncIterator[bytes]:
        """Each event's `data:` payload (bytes), in order."""
        while True:
            while b"\n\n" not in self._buffer:
                if not await self._more():
                    last = _event_data(self._buffer)
                    if last:
                        yield last
                    return
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            payload = _event_data(event)
            if payload:
                yield payload


def _event_data(event: bytes) -> bytes:
    """The data of one SSE event (its `data:` lines joined), b"" for comments and pings."""
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


async def stream_chat_lean(
    url: str, body: dict[str, Any], *, route: str = "chat", timeout: float = 300.0
) -> StreamResult:
    """`stream_chat` over a bare asyncio connection: the same request, chunks and timings,
    with a load generator's overhead (HTTP read by hand, one `json.loads` per chunk) instead
    of an HTTP client library's (about 4x less CPU per streamed token), so that on a small
    machine the client takes little of the CPU the server under test needs."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    payload = json.dumps(
        {**body, "stream": True, "stream_options": {"include_usage": True}}
    ).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    sent = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(head + payload)
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
        headers: dict[bytes, bytes] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        chunked = headers.get(b"transfer-encoding") == b"chunked"
        if status != 200:
            raise RuntimeError(f"{url}{path}: {status} {(await reader.read(200))!r}")
        tally = _ChunkTally(sent)
        async for data in _SseReader(reader, chunked).events():
            if data == b"[DONE]":
                break
            tally.feed(json.loads(data))
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return tally.result()


async def concurrent_round(
    url: str,
    bodies: Sequence[dict[str, Any]],
    *,
    route: str = "chat",
    timeout: float = 300.0,
    client: str = "httpx",
) -> list[StreamResult]:
    """Send all `bodies` at once (one connection each) and wait for every stream.

    `client`: "httpx" (an `httpx.AsyncClient`, as applications stream) or "lean"
    (`stream_chat_lean`: a bare connection per stream, the lighter load generator)."""
    if client == "lean":
        lean = [stream_chat_lean(url, body, route=route, timeout=timeout) for body in bodies]
        return list(await asyncio.wait_for(asyncio.gather(*lean), timeout))
    limits = httpx.Limits(max_connections=len(bodies) + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        tasks = [stream_chat(http, url, body, route=route) for body in bodies]
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout))


def aggregate_decode_rate(results: Iterable[StreamResult]) -> float:
    """Decode tok/s of concurrent streams: tokens after each first one, over the span from the
    earliest first token to the latest last one."""
    rows = list(results)
    tokens = sum(max(0, r.tokens - 1) for r in rows)
    span = max(r.last for r in rows) - min(r.first for r in rows)
    return tokens / span if span > 0 else 0.0


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def spread(values: Sequence[float]) -> str:
    """`min-max` of `values`, for noise notes."""
    return f"{min(values):.1f}-{max(values):.1f}"


def load_note() -> str:
    """The 1-minute load average and CPU count, to judge noise."""
    with contextlib.suppress(OSError):
        return f"load {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    return ""
