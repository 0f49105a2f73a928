"""Meta Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`.

The call is the whole output (or starts it, after whitespace), or follows `<|python_tag|>`;
several calls may follow each other separated by `;`. Built-in tools written as
`<|python_tag|>brave_search.call(query="...")` are read as pythonic calls. Name and arguments
stream while generated; arguments stay verbatim. Output that only looks like JSON (a first key
other than "name", or a name that is not a declared tool) is content.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.functionary_v31 import NAME_CHARS
from mlxcel.engine.chat.tool_calls.jsoncalls import JsonKeys, JsonRegion, probe_json_call
from mlxcel.engine.chat.tool_calls.markup import (
    MORE,
    NO,
    Drop,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
)
from mlxcel.engine.chat.tool_calls.pythonic import BracketRegion

PYTHON_TAG = "<|python_tag|>"
KEYS = JsonKeys(name=("name",), arguments=("parameters", "arguments"), wrappers=())


class Llama3Format(MarkupFormat):
    """Llama 3.x JSON calls."""

    name = "llama3"
    streams_arguments = True
    start_markers = (PYTHON_TAG,)
    separators = ";"

    def probe(self, marker: str, view: str, ctx: ProbeContext) -> ProbeResult:
        at = len(marker)
        while at < len(view) and view[at].isspace():
            at += 1
        if at == len(view):
            return MORE
        if view[at] == "{":
            return Open(at, JsonRegion(KEYS, preview=True))
        start = at
        while at < len(view) and view[at] in NAME_CHARS:
            at += 1
        if at == len(view):
            return MORE
        if at > start and view[at] == "(":
            return Open(start, BracketRegion())
        return Drop(len(marker))

    def probe_boundary(self, view: str, ctx: ProbeContext) -> ProbeResult:
        if not view.startswith("{"):
            return NO
        answer = probe_json_call(view, ctx.tools, KEYS)
        if answer == "yes":
            return Open(0, JsonRegion(KEYS, preview=True))
        return answer
