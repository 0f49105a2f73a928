"""Moonshot Kimi K2 (line breaks added here)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0
        <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_calls_section_end|>

The call id (`functions.NAME:INDEX`) is kept as the call's id, since Kimi's template writes
it back verbatim in later turns; the name is the part between `functions.` and `:`. Each
call is reported when its `<|tool_call_end|>` arrives; arguments stay verbatim.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import partial_suffix_len
from mlxcel.engine.chat.tool_calls.markup import (
    Body,
    CallSink,
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
)

SECTION_OPEN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_CLOSE = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_OPEN = "<|tool_call_begin|>"
ARGUMENT_OPEN = "<|tool_call_argument_begin|>"
CALL_CLOSE = "<|tool_call_end|>"


def name_of(call_id: str) -> str:
    """`functions.get_weather:0` → `get_weather`."""
    name = call_id.strip()
    if name.startswith("functions."):
        name = name[len("functions.") :]
    head, colon, index = name.rpartition(":")
    if colon and index.isdigit():
        name = head
    return name


class KimiBody(Body):
    """Calls between section markers (or one call after a bare `<|tool_call_begin|>`)."""

    def __init__(self, *, in_call: bool) -> None:
        self._buf = CALL_OPEN if in_call else ""
        self._search = 0  # where the next end marker may start

    def consume(self, text: str, sink: CallSink) -> None:
        self._buf += text
        while True:
            start = self._buf.find(CALL_OPEN)
            if start < 0:
                self._buf = self._buf[
                    len(self._buf) - partial_suffix_len(self._buf, (CALL_OPEN,)) :
                ]
                self._search = 0
                return
            end = self._buf.find(CALL_CLOSE, max(self._search, start))
            if end < 0:
                self._search = len(self._buf) - partial_suffix_len(self._buf, (CALL_CLOSE,))
                return
            self._report(self._buf[start + len(CALL_OPEN) : end], sink, complete=True)
            self._buf = self._buf[end + len(CALL_CLOSE) :]
            self._search = 0

    def close(self, sink: CallSink, complete: bool) -> None:
        start = self._buf.find(CALL_OPEN)
        if start >= 0:  # a call without its end: cut off, its arguments as generated
            self._report(self._buf[start + len(CALL_OPEN) :], sink, complete=False)
        self._buf = ""

    def _report(self, call: str, sink: CallSink, *, complete: bool) -> None:
        head, found, arguments = call.partition(ARGUMENT_OPEN)
        name = name_of(head)
        if found and name:
            empty = "{}" if complete else ""
            sink.call(name, arguments.strip() or empty, head.strip())


class KimiK2Format(MarkupFormat):
    """`<|tool_calls_section_begin|>` sections of `<|tool_call_begin|>` calls."""

    name = "kimi_k2"
    start_markers = (*SECTION_OPEN, CALL_OPEN)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        if marker == CALL_OPEN:
            return MarkerRegion((CALL_CLOSE,), KimiBody(in_call=True))
        return MarkerRegion(SECTION_CLOSE, KimiBody(in_call=False))
