"""Hermes / Qwen / DeepSeek: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Each block holds one JSON call (a list of them is accepted too); blocks follow each other
for parallel calls. Name and arguments stream while generated; arguments stay verbatim.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.jsoncalls import JsonBody
from mlxcel.engine.chat.tool_calls.markup import MarkerRegion, MarkupFormat, ProbeContext, Region

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesFormat(MarkupFormat):
    """`<tool_call>` JSON blocks."""

    name = "hermes"
    streams_arguments = True
    start_markers = (OPEN,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        return MarkerRegion((CLOSE,), JsonBody(preview=True))
