"""Pythonic calls: `<|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|>`
(LFM2, some Nemotron templates), or the same list bare at the start of the output (Llama 3.2
and Llama 4 pythonic tool use). Arguments are keyword literals, converted to JSON; calls
arrive whole.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import tool_names
from mlxcel.engine.chat.tool_calls.functionary_v31 import NAME_CHARS
from mlxcel.engine.chat.tool_calls.markup import (
    MORE,
    NO,
    CallSink,
    MarkerRegion,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
    Region,
    TextBody,
)
from mlxcel.engine.chat.tool_calls.values import MAX_LITERAL_CHARS, parse_pythonic

OPEN = "<|tool_call_start|>"
CLOSE = "<|tool_call_end|>"
_PAIRS = {"(": ")", "[": "]", "{": "}"}


def report_pythonic(text: str, sink: CallSink) -> None:
    """Report the calls of a pythonic call list (nothing if it is not one)."""
    for name, arguments in parse_pythonic(text) or ():
        sink.call(name, arguments)


class BracketRegion(Region):
    """Text up to the bracket that closes the first one, skipping quoted strings; then
    parsed as pythonic calls. Gives up (no call) past `MAX_LITERAL_CHARS`."""

    def __init__(self) -> None:
        self._text = ""
        self._at = 0
        self._stack: list[str] = []
        self._quote = ""
        self._escape = False
        self._opened = False

    def feed(self, text: str, sink: CallSink) -> str | None:
        self._text += text
        end = self._scan()
        if end is None:
            return None
        self.consumed = self._text[:end]
        report_pythonic(self.consumed, sink)
        return self._text[end:]

    def close(self, sink: CallSink) -> None:
        self.consumed = self._text

    def _scan(self) -> int | None:
        text = self._text
        while self._at < len(text):
            char = text[self._at]
            self._at += 1
            if self._at > MAX_LITERAL_CHARS:
                return self._at
            if self._quote:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == self._quote:
                    self._quote = ""
            elif char in "\"'":
                self._quote = char
            elif char in _PAIRS:
                self._stack.append(_PAIRS[char])
                self._opened = True
            elif self._stack and char == self._stack[-1]:
                self._stack.pop()
                if not self._stack:
                    return self._at
            elif char in ")]}":
                return self._at
        return None


def probe_bare_list(view: str, ctx: ProbeContext) -> ProbeResult:
    """Does `view` (starting with "[") open a bare pythonic call list `[name(`?"""
    at = 1
    while at < len(view) and view[at].isspace():
        at += 1
    start = at
    while at < len(view) and view[at] in NAME_CHARS:
        at += 1
    if at == len(view):
        return MORE
    name = view[start:at]
    if not name or view[at] != "(" or name[0].isdigit():
        return NO
    names = tool_names(ctx.tools)
    if names and name not in names:
        return NO
    return Open(0, BracketRegion())


class PythonicFormat(MarkupFormat):
    """`<|tool_call_start|>[f(a=1)]<|tool_call_end|>` and bare `[f(a=1)]` at the start."""

    name = "pythonic"
    start_markers = (OPEN,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        return MarkerRegion((CLOSE,), TextBody(lambda text, sink, _: report_pythonic(text, sink)))

    def probe_boundary(self, view: str, ctx: ProbeContext) -> ProbeResult:
        if not view.startswith("["):
            return NO
        return probe_bare_list(view, ctx)
