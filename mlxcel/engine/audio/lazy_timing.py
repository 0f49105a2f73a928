"""Import mlx-whisper without paying for its word-timestamp module up front.

`mlx_whisper` imports `mlx_whisper.timing` from its package `__init__`, and that module
imports numba and `scipy.signal` at its top: 1-3 s of every `mlxcel transcribe`, spent even
when no word timestamps are asked for. `install()` puts a stand-in module under that name
first; the real one is imported the first time anything from it is used (an attribute of
the stand-in, or `add_word_timestamps`), and then replaces the stand-in everywhere.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

NAME = "mlx_whisper.timing"


class _StandIn(types.ModuleType):
    """Forwards every attribute to the real module, importing it on first use."""

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # the import system probes __path__, __spec__, ...
            raise AttributeError(attribute)
        return getattr(real(), attribute)


def _add_word_timestamps(*args: Any, **kwargs: Any) -> Any:
    return real().add_word_timestamps(*args, **kwargs)


def install() -> None:
    """Register the stand-in, unless mlx-whisper (or its timing module) is already loaded."""
    if NAME in sys.modules or "mlx_whisper" in sys.modules:
        return
    stand_in = _StandIn(NAME, __doc__)
    stand_in.add_word_timestamps = _add_word_timestamps  # type: ignore[attr-defined]
    stand_in.__mlxcel_stand_in__ = True  # type: ignore[attr-defined]
    sys.modules[NAME] = stand_in


def is_stand_in(module: Any) -> bool:
    """Whether `module` is the stand-in (the real timing module is not imported yet)."""
    return bool(getattr(module, "__dict__", {}).get("__mlxcel_stand_in__"))


def real() -> types.ModuleType:
    """The real `mlx_whisper.timing` (imported now if only the stand-in was there)."""
    current = sys.modules.get(NAME)
    if current is not None and not is_stand_in(current):
        return current
    sys.modules.pop(NAME, None)
    module = importlib.import_module(NAME)
    package = sys.modules.get("mlx_whisper")
    if package is not None:
        package.timing = module  # type: ignore[attr-defined]
    transcribe_module = sys.modules.get("mlx_whisper.transcribe")
    if transcribe_module is not None:
        transcribe_module.add_word_timestamps = module.add_word_timestamps  # type: ignore[attr-defined]
    return module
