"""MiniMax M2: XML invocations inside `<minimax:tool_call>`::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

A bare `<invoke name="...">...</invoke>` is accepted too. Parameter values are plain text,
typed by the tool schema. Each block's calls are reported when the block ends.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import Tools, tool_parameters
from mlxcel.engine.chat.tool_calls.markup import (
    CallSink,
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
    TextBody,
)
from mlxcel.engine.chat.tool_calls.values import typed_arguments

BLOCK_OPEN = "<minimax:tool_call>"
BLOCK_CLOSE = "</minimax:tool_call>"
INVOKE_OPEN = "<invoke name="
INVOKE_CLOSE = "</invoke>"
PARAM_OPEN = "<parameter name="
PARAM_CLOSE = "</parameter>"


def read_attribute(text: str, at: int) -> tuple[str, int] | None:
    """An attribute value at `at` ("x", 'x' or bare) up to the tag's `>`: (value, index after
    the `>`), or None if the tag is not closed."""
    close = text.find(">", at)
    if close < 0:
        return None
    value = text[at:close].strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return value, close + 1


def parse_invokes(text: str, tools: Tools | None, sink: CallSink) -> None:
    """Report every `<invoke name=...>` element in `text` (the last may lack its end tag)."""
    at = text.find(INVOKE_OPEN)
    while at >= 0:
        attribute = read_attribute(text, at + len(INVOKE_OPEN))
        if attribute is None:
            return
        name, start = attribute
        end = text.find(INVOKE_CLOSE, start)
        body = text[start:] if end < 0 else text[start:end]
        if name:
            parameters = tool_parameters(tools, name)
            sink.call(name, typed_arguments(_parameters(body), parameters))
        if end < 0:
            return
        at = text.find(INVOKE_OPEN, end)


def _parameters(body: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    at = body.find(PARAM_OPEN)
    while at >= 0:
        attribute = read_attribute(body, at + len(PARAM_OPEN))
        if attribute is None:
            break
        key, start = attribute
        end = body.find(PARAM_CLOSE, start)
        following = body.find(PARAM_OPEN, start)
        if end < 0 or (0 <= following < end):
            end = len(body) if following < 0 else following
            pairs.append((key, body[start:end]))
            at = following
            continue
        pairs.append((key, body[start:end]))
        at = body.find(PARAM_OPEN, end)
    return pairs


class MinimaxM2Format(MarkupFormat):
    """`<minimax:tool_call>` blocks of `<invoke>` elements."""

    name = "minimax_m2"
    start_markers = (BLOCK_OPEN, INVOKE_OPEN)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        tools = ctx.tools
        if marker == BLOCK_OPEN:
            return MarkerRegion(
                (BLOCK_CLOSE,), TextBody(lambda text, sink, _: parse_invokes(text, tools, sink))
            )
        return MarkerRegion(
            (INVOKE_CLOSE,),
            TextBody(lambda text, sink, _: parse_invokes(INVOKE_OPEN + text, tools, sink)),
        )
