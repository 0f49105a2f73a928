"""The bounded thread pool that media work runs on, so the event loop keeps serving.

Decoding base64, reading local files, decoding and checking pictures, sampling video frames
with ffmpeg, decoding audio and running a vision model's processor can each take seconds on
a large input (a 7000x7000 1-bit PNG is 8 KB on the wire and 49 M pixels decoded). Every
route that takes media awaits `off_loop` for that work: the loop answers `/health` and other
requests meanwhile. The pool is bounded: at most `MAX_WORKERS` media jobs run at once, the
rest wait their turn (memory stays bounded by the body caps times the workers).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MAX_WORKERS = max(2, min(4, os.cpu_count() or 1))
THREAD_PREFIX = "mlxcel-media"

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_WORKERS, thread_name_prefix=THREAD_PREFIX)
        return _pool


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` run on the media pool; its result (or exception) once done."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))
