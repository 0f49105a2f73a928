"""Chat: message normalization and sandboxed chat templates.

The names below load lazily, so importing this package does not import Jinja.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CHATML_TEMPLATE": "mlxcel.engine.chat.template",
    "ChatTemplate": "mlxcel.engine.chat.template",
    "TemplateError": "mlxcel.engine.chat.template",
    "detect_family": "mlxcel.engine.chat.template",
    "normalize_messages": "mlxcel.engine.chat.messages",
    "remove_think": "mlxcel.engine.chat.messages",
    "strip_think_blocks": "mlxcel.engine.chat.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)
