"""The bounded thread pool that media work runs on, so the event loop keeps serving.

Decoding base64, reading local files, decoding and checking pictures, sampling video frames
with ffmpeg, decoding audio and running a vision model's processor can each take seconds on
a large input (a 7000x7000 1-bit PNG is 8 KB on the wire and 49 M pixels decoded). Every
route that takes media awaits `off_loop` for that work: the loop answers `/health` and other
requests meanwhile. The pool is bounded: at most `MAX_WORKERS` media jobs run at once, the
rest wait their turn (memory stays bounded by the body caps times the workers).

A worker running Python keeps the GIL until another thread has waited the interpreter's
switch interval for it (5 ms by default), so each time the loop needs the GIL while media
work runs it could wait that long; the pool shortens the interval to `SWITCH_INTERVAL` for
the process when it starts. Work that holds the GIL in one C call is cut by its callers into
pieces well under a millisecond (base64 decoding, the scan that lifts a data URI out of a
JSON body).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MAX_WORKERS = max(2, min(4, os.cpu_count() or 1))
THREAD_PREFIX = "mlxcel-media"
SWITCH_INTERVAL = 0.0005
"""Seconds a thread may hold the GIL while another waits for it, once the pool runs."""

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
            _pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix=THREAD_PREFIX)
        return _pool


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` run on the media pool; its result (or exception) once done."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
