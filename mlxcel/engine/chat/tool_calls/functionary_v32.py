"""Meetkai Functionary v3.2: `>>>RECIPIENT\nBODY` segments.

The recipient `all` means the body is text for the user; any other recipient is a tool and
the body its JSON arguments (raw code for `python`). The generation prompt ends with `>>>`, so
the first segment comes without it; there the recipient must be `all` or a declared tool.
A call ends where the next `>>>` starts, or at the end of the output.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import tool_names
from mlxcel.engine.chat.tool_calls.functionary_v31 import body_arguments, read_name
from mlxcel.engine.chat.tool_calls.markup import (
    NO,
    CallSink,
    Drop,
    MarkerRegion,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
    TextBody,
)

MARKER = ">>>"
CONTENT_RECIPIENT = "all"


class FunctionaryV32Format(MarkupFormat):
    """`>>>name\\n{json}` segments."""

    name = "functionary_v32"
    start_markers = (MARKER,)

    def probe(self, marker: str, view: str, ctx: ProbeContext) -> ProbeResult:
        return self._segment(view, len(MARKER), ctx, bare=False)

    def probe_boundary(self, view: str, ctx: ProbeContext) -> ProbeResult:
        if view.startswith(MARKER):
            return NO  # the marker path handles it
        return self._segment(view, 0, ctx, bare=True)

    def _segment(self, view: str, start: int, ctx: ProbeContext, *, bare: bool) -> ProbeResult:
        found = read_name(view, start, "\n")
        if isinstance(found, str):
            return found
        name, length = found
        if name == CONTENT_RECIPIENT:
            return Drop(length)
        if bare and name not in tool_names(ctx.tools):
            return NO

        def parse(text: str, sink: CallSink, complete: bool) -> None:
            arguments = body_arguments(name, text)
            if arguments is not None:
                sink.call(name, arguments)

        return Open(length, MarkerRegion((MARKER,), TextBody(parse), keep_end=True))
