"""Where media work runs, so the event loop keeps serving: a bounded thread pool, and worker
processes for the decoding that costs the most CPU.

Decoding base64, reading local files, decoding and checking pictures, sampling video frames
with ffmpeg, decoding audio and running a vision model's processor can each take seconds on
a large input (a 7000x7000 1-bit PNG is 8 KB on the wire and 49 M pixels decoded). Every
route that takes media awaits `off_loop` (the thread pool) or `off_process` for that work:
the loop answers `/health` and other requests meanwhile. Both are bounded: at most
`MAX_WORKERS` media jobs run on threads and `MAX_PROCESSES` in processes at once, the rest
wait their turn (memory stays bounded by the body caps times the workers).

Threads share the server's GIL: each time the loop needs it while a worker runs Python or a
C call that keeps it, the loop waits, and on a 2-core machine it also waits for a CPU that
the workers' GIL-free decoding occupies (bench/media_event_loop.py, four 1280x720 PNG data
URIs at a time on the loaded 2-core development VM, five runs: the loop's worst lag beyond
its own CPU wait 8.2-11.0 ms with the decoding on threads, 4.2-8.5 ms in processes; most
of the worst lag is waiting for a CPU, docs/vision.md). So the decoding of data URIs
and pictures (`off_process`) runs in spawned worker processes with a lower CPU priority
(`PROCESS_NICENESS`): they hold no lock the loop needs, and the loop thread wins a CPU over
them. `MLXCEL_MEDIA_PROCESSES=0` keeps that work on the threads.

A worker thread running Python keeps the GIL until another thread has waited the
interpreter's switch interval for it (5 ms by default), so the thread pool shortens the
interval to `SWITCH_INTERVAL` for the process when it starts. Work that holds the GIL in one
C call is cut by its callers into pieces well under a millisecond (base64 decoding, the scan
that lifts a data URI out of a JSON body).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

from mlxcel.config import process_env
from mlxcel.engine.media.errors import MediaError

P = ParamSpec("P")
T = TypeVar("T")

MAX_WORKERS = max(2, min(4, os.cpu_count() or 1))
MAX_PROCESSES = max(1, min(4, os.cpu_count() or 1))
THREAD_PREFIX = "mlxcel-media"
SWITCH_INTERVAL = 0.0005
"""Seconds a thread may hold the GIL while another waits for it, once the pool runs."""
PROCESS_NICENESS = 10
"""How much lower the worker processes' CPU priority is than the server's (Unix nice)."""

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_processes: tuple[ProcessPoolExecutor, Future[int]] | None = None
_STARTING = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{THREAD_PREFIX}-start")
"""Runs a new pool's first job: spawning a worker (fork/exec) never runs on the loop."""
_processes_failed = False  # this system cannot start them: the threads do their work


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
            _pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix=THREAD_PREFIX)
        return _pool


PARENT_CHECK_S = 1.0
"""How often a worker process checks that the server that started it is still there."""


def _process_started() -> None:
    """A worker process's first step: lower its CPU priority under the server's, and leave
    once the server is gone (a killed server's workers would otherwise live on: each holds
    its own end of the queue it waits on, so it never sees the server go)."""
    if hasattr(os, "nice"):
        os.nice(PROCESS_NICENESS)
    server = os.getppid()

    def watch() -> None:
        while os.getppid() == server:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="mlxcel-media-parent", daemon=True).start()


def _process_executor() -> tuple[ProcessPoolExecutor, Future[int]] | None:
    """The worker processes (spawned on first use) and their first job, a no-op that tells
    whether a worker can start here at all; None where they are turned off or cannot."""
    global _processes
    if not process_env.media_processes() or _processes_failed:
        return None
    with _lock:
        if _processes is None:
            context = multiprocessing.get_context("spawn")  # never fork a threaded server
            try:
                pool = ProcessPoolExecutor(
                    MAX_PROCESSES, mp_context=context, initializer=_process_started
                )
            except (OSError, NotImplementedError) as exc:  # no semaphores, say
                _cannot_start(exc)
                return None
            _processes = (pool, _STARTING.submit(_first_job, pool))
        return _processes


def _first_job(pool: ProcessPoolExecutor) -> int:
    """A worker's pid, once one has started (BrokenProcessPool where none can)."""
    return pool.submit(os.getpid).result()


def _cannot_start(exc: BaseException) -> None:
    global _processes_failed, _processes
    log.warning("media worker processes cannot start (%s); media decode on threads", exc)
    _processes_failed, _processes = True, None


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` run on the media thread pool; its result (or exception)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


async def off_process(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` run in a media worker process (on the thread pool where the
    processes are turned off); its result (or exception).

    `fn` is a module-level function whose arguments, result and exceptions pickle. A worker
    that dies (an input that crashed a decoder, a kill) fails the jobs it had with
    MediaError (a 400), never the server; the next call gets a new pool. Where worker
    processes cannot start at all, the threads do the work from then on (with a warning)."""
    started = _process_executor()
    if started is None:
        return await off_loop(fn, *args, **kwargs)
    pool, first = started
    try:  # a worker that cannot start at all (spawn cannot import the main module, say)
        await asyncio.wrap_future(first)
    except (BrokenProcessPool, OSError, NotImplementedError) as exc:
        with _lock:
            if _processes is not None and _processes[0] is pool:
                _cannot_start(exc)
        pool.shutdown(wait=False, cancel_futures=True)
        return await off_loop(fn, *args, **kwargs)
    try:
        # submit spawns the workers it lacks (fork/exec, ms each): on a thread, not the loop
        future = await off_loop(pool.submit, functools.partial(fn, *args, **kwargs))
    except BrokenProcessPool:  # it broke since: a new pool
        _drop(pool)
        return await off_process(fn, *args, **kwargs)
    except (OSError, NotImplementedError) as exc:
        with _lock:
            _cannot_start(exc)
        pool.shutdown(wait=False, cancel_futures=True)
        return await off_loop(fn, *args, **kwargs)
    try:
        return await asyncio.wrap_future(future)
    except BrokenProcessPool:
        _drop(pool)
        raise MediaError("the media worker process stopped while decoding this input") from None


def _drop(pool: ProcessPoolExecutor) -> None:
    """Forget a broken pool; the next call starts a new one."""
    global _processes
    with _lock:
        if _processes is not None and _processes[0] is pool:
            _processes = None
    pool.shutdown(wait=False, cancel_futures=True)
