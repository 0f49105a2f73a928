"""Meetkai Functionary v3.1 (Llama 3.1 based): `<function=NAME>{json}</function>`.

The arguments are the JSON between the tags, verbatim; for the `python` tool a body that
is not JSON is code and becomes `{"code": ...}`. Calls arrive whole when their end tag does.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.jsonscan import is_json
from mlxcel.engine.chat.tool_calls.markup import (
    MORE,
    NO,
    CallSink,
    MarkerRegion,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
    TextBody,
)
from mlxcel.engine.chat.tool_calls.values import arguments_json

OPEN = "<function="
CLOSE = "</function>"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
_NAME_LIMIT = 128


def body_arguments(name: str, body: str, *, complete: bool = True) -> str | None:
    """A call body as arguments: JSON verbatim, "{}" when empty, code for `python`. A body
    cut off before its end marker (max_tokens) is its text as generated ("" when empty)."""
    text = body.strip()
    if not text:
        return "{}" if complete else ""
    if is_json(text):
        return text
    if name in ("python", "ipython"):
        return arguments_json([("code", text)])
    return None if complete else text


def read_name(view: str, start: int, end_char: str) -> tuple[str, int] | str:
    """A tool name at `start` ended by `end_char`: (name, index after it), or NO / MORE."""
    at = start
    while at < len(view) and view[at] in NAME_CHARS and at - start < _NAME_LIMIT:
        at += 1
    if at == len(view):
        return MORE
    if view[at] != end_char or at == start:
        return NO
    return view[start:at], at + 1


class FunctionaryV31Format(MarkupFormat):
    """`<function=NAME>{json}</function>` calls."""

    name = "functionary_v31"
    start_markers = (OPEN,)

    def probe(self, marker: str, view: str, ctx: ProbeContext) -> ProbeResult:
        found = read_name(view, len(OPEN), ">")
        if isinstance(found, str):
            return found
        name, length = found

        def parse(text: str, sink: CallSink, complete: bool) -> None:
            arguments = body_arguments(name, text, complete=complete)
            if arguments is not None:
                sink.call(name, arguments)

        return Open(length, MarkerRegion((CLOSE,), TextBody(parse)))
