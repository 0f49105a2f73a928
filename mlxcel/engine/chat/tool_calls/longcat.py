"""LongCat-Flash (longcat_flash, longcat_flash_ngram)::

    <longcat_tool_call>get_weather
    <longcat_arg_key>city</longcat_arg_key>
    <longcat_arg_value>Paris</longcat_arg_value>
    </longcat_tool_call>

Values are typed by the tool schema, as for GLM-4.7; a JSON body
(`<longcat_tool_call>{"name": ..., "arguments": ...}`) is read as a Hermes call.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.glm47 import parse_key_value_call
from mlxcel.engine.chat.tool_calls.markup import (
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
    TextBody,
)

OPEN = "<longcat_tool_call>"
CLOSE = "</longcat_tool_call>"


class LongcatFormat(MarkupFormat):
    """`<longcat_tool_call>` blocks with `<longcat_arg_key>`/`<longcat_arg_value>` pairs."""

    name = "longcat"
    start_markers = (OPEN,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        tools = ctx.tools
        return MarkerRegion(
            (CLOSE,),
            TextBody(
                lambda text, sink, _: parse_key_value_call(
                    text, "longcat_arg_key", "longcat_arg_value", tools, sink
                )
            ),
        )
