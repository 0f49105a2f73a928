"""MiniMax M3: namespaced XML, every tag prefixed with `]<]minimax[>[`::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">
    ]<]minimax[>[<city>Paris]<]minimax[>[</city>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Parameters are named by their tag. The prefix is removed wherever it appears (closing tags
are sometimes written without it); values are typed by the tool schema.
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
from mlxcel.engine.chat.tool_calls.minimax_m2 import INVOKE_CLOSE, INVOKE_OPEN, read_attribute
from mlxcel.engine.chat.tool_calls.values import typed_arguments

NS = "]<]minimax[>["
OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")


def parse_block(text: str, tools: Tools | None, sink: CallSink) -> None:
    """Report the `<invoke>` elements of one block (namespace prefixes removed first)."""
    text = text.replace(NS, "")
    at = text.find(INVOKE_OPEN)
    while at >= 0:
        attribute = read_attribute(text, at + len(INVOKE_OPEN))
        if attribute is None:
            return
        name, start = attribute
        end = text.find(INVOKE_CLOSE, start)
        body = text[start:] if end < 0 else text[start:end]
        if name:
            sink.call(name, typed_arguments(tag_pairs(body), tool_parameters(tools, name)))
        if end < 0:
            return
        at = text.find(INVOKE_OPEN, end)


def tag_pairs(body: str) -> list[tuple[str, str]]:
    """`<key>value</key>` pairs in order; a value runs to its own closing tag."""
    pairs: list[tuple[str, str]] = []
    at = body.find("<")
    while at >= 0:
        close = body.find(">", at)
        if close < 0:
            break
        tag = body[at + 1 : close]
        if not tag or not all(c in _TAG_CHARS for c in tag):
            at = body.find("<", at + 1)
            continue
        end = body.find(f"</{tag}>", close + 1)
        if end < 0:
            pairs.append((tag, body[close + 1 :]))
            break
        pairs.append((tag, body[close + 1 : end]))
        at = body.find("<", end + len(tag) + 3)
    return pairs


class MinimaxM3Format(MarkupFormat):
    """Namespaced `<tool_call>` blocks."""

    name = "minimax_m3"
    start_markers = (NS + OPEN, OPEN)
    drop_markers = (NS,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        tools = ctx.tools
        return MarkerRegion(
            (CLOSE,), TextBody(lambda text, sink, _: parse_block(text, tools, sink))
        )
