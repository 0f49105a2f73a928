"""Keep the process's open-file limit as the user set it when mlx-lm is imported.

Importing `mlx_lm.utils` runs `resource.setrlimit(RLIMIT_NOFILE, (2048, 4096))`. Where the
hard limit is under 4096 (`ulimit -n 1024`) that raises ValueError, so nothing that imports
mlx-lm can load; where it is higher, the limits drop to 2048/4096 and a busy server runs
out of sockets. `keep_file_limit()` makes mlx-lm's calls safe: its soft limit may rise (up
to the hard limit, as it wants for models of many files), nothing is ever lowered, the hard
limit is left alone. Calls from anywhere else reach `resource.setrlimit` unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

try:
    import resource
except ImportError:  # Windows: no resource limits to keep
    resource = None  # type: ignore[assignment]

_CALLER = "mlx_lm"


def keep_file_limit() -> None:
    """Wrap `resource.setrlimit` once so mlx-lm's calls keep the file limit (see module)."""
    if resource is None or getattr(resource.setrlimit, "_mlxcel_guard", False):
        return
    original = resource.setrlimit

    def setrlimit(which: int, limits: tuple[int, int], /) -> None:
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        if which == resource.RLIMIT_NOFILE and (
            caller == _CALLER or caller.startswith(f"{_CALLER}.")
        ):
            limits = safe_file_limit(limits[0], resource.getrlimit(resource.RLIMIT_NOFILE))
        original(which, limits)

    guarded: Callable[..., Any] = setrlimit
    guarded._mlxcel_guard = True  # type: ignore[attr-defined]
    resource.setrlimit = guarded


def safe_file_limit(wanted_soft: int, current: tuple[int, int]) -> tuple[int, int]:
    """The (soft, hard) file limit to set for a request of `wanted_soft`: the soft limit
    raised toward it within the hard limit, never lowered; the hard limit unchanged."""
    soft, hard = current
    infinity = resource.RLIM_INFINITY if resource is not None else -1
    ceiling = wanted_soft if hard == infinity else min(wanted_soft, hard)
    if soft == infinity or ceiling <= soft:
        return soft, hard
    return ceiling, hard
