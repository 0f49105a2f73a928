"""Function-calling Gemma checkpoints (FunctionGemma):
`<start_function_call>call:NAME{key:<escape>text<escape>,...}<end_function_call>`.

Same object syntax as Gemma 4 with `<escape>` as the string quote. Calls arrive whole.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.gemma4 import report_calls
from mlxcel.engine.chat.tool_calls.markup import (
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
    TextBody,
)

OPEN = "<start_function_call>"
CLOSE = "<end_function_call>"
QUOTE = "<escape>"


class FunctionGemmaFormat(MarkupFormat):
    """`<start_function_call>...<end_function_call>` blocks."""

    name = "function_gemma"
    start_markers = (OPEN,)
    drop_markers = ("<start_function_response>",)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        return MarkerRegion(
            (CLOSE,), TextBody(lambda text, sink, _: report_calls(text, QUOTE, sink))
        )
