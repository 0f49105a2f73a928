"""GLM-4.5/4.6/4.7 (glm4_moe, glm4_moe_lite, glm_moe_dsa, glm4v_moe)::

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

(older checkpoints put newlines between the parts). Values are plain text, typed by the tool
schema: string parameters keep the text exactly, others are read as JSON or a loose literal.
A JSON body is read as a Hermes call.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import Tools, tool_parameters
from mlxcel.engine.chat.tool_calls.jsoncalls import parse_calls_text
from mlxcel.engine.chat.tool_calls.markup import (
    CallSink,
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
    TextBody,
)
from mlxcel.engine.chat.tool_calls.values import typed_arguments

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def parse_key_value_call(
    body: str, key_tag: str, value_tag: str, tools: Tools | None, sink: CallSink
) -> None:
    """Report the call in a `NAME<key>k</key><value>v</value>...` body (or a JSON body)."""
    key_open, key_close = f"<{key_tag}>", f"</{key_tag}>"
    value_open, value_close = f"<{value_tag}>", f"</{value_tag}>"
    if body.lstrip().startswith("{"):
        for name, arguments in parse_calls_text(body):
            sink.call(name, arguments)
        return
    first = body.find(key_open)
    name = (body if first < 0 else body[:first]).strip()
    if not name or "\n" in name or "<" in name:
        return
    pairs: list[tuple[str, str]] = []
    at = first
    while at >= 0:
        key_end = body.find(key_close, at)
        if key_end < 0:
            break
        key = body[at + len(key_open) : key_end].strip()
        start = body.find(value_open, key_end)
        if start < 0:
            break
        start += len(value_open)
        next_key = body.find(key_open, start)
        end = body.find(value_close, start)
        if end < 0 or (0 <= next_key < end):
            end = len(body) if next_key < 0 else next_key
            pairs.append((key, body[start:end]))
            at = next_key
            continue
        pairs.append((key, body[start:end]))
        at = body.find(key_open, end)
    sink.call(name, typed_arguments(pairs, tool_parameters(tools, name)))


class Glm47Format(MarkupFormat):
    """`<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>`."""

    name = "glm47"
    start_markers = (OPEN,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        tools = ctx.tools
        return MarkerRegion(
            (CLOSE,),
            TextBody(
                lambda text, sink, _: parse_key_value_call(
                    text, "arg_key", "arg_value", tools, sink
                )
            ),
        )
