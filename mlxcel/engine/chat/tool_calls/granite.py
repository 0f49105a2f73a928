"""IBM Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}]`, and the
`<tool_call>{json}</tool_call>` blocks Granite 3.3 writes inside `<response>...</response>`.

The `<response>` wrapper tags are removed from the content; calls arrive whole.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.jsoncalls import JsonBody, JsonRegion
from mlxcel.engine.chat.tool_calls.markup import MarkerRegion, MarkupFormat, ProbeContext, Region

LIST_MARKER = "<|tool_call|>"
OPEN = "<tool_call>"
CLOSE = "</tool_call>"
RESPONSE_TAGS = ("<response>", "</response>")


class GraniteFormat(MarkupFormat):
    """`<|tool_call|>` lists and `<tool_call>` blocks."""

    name = "granite"
    start_markers = (LIST_MARKER, OPEN)
    drop_markers = RESPONSE_TAGS

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        if marker == LIST_MARKER:
            return JsonRegion(preview=False)
        return MarkerRegion((CLOSE,), JsonBody(preview=False))
