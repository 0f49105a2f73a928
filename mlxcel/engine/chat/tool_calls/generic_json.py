"""Generic JSON calls for templates with no wire format of their own:
`{"name": ..., "arguments": {...}}`, a list of such objects, or `{"tool_calls": [...]}`.

The JSON must start the output (after whitespace, optionally inside a ```json fence) or follow
a previous call. It counts as a call only if its first key is "name" followed by an arguments
key (the name a declared tool when tools are given) or a `tool_calls` wrapper; any other
JSON is content. Calls arrive whole; arguments stay verbatim.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.jsoncalls import (
    JsonBody,
    JsonRegion,
    probe_json_call,
)
from mlxcel.engine.chat.tool_calls.markup import (
    MORE,
    NO,
    MarkerRegion,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
)

FENCE = "```"


class GenericJsonFormat(MarkupFormat):
    """Bare JSON calls at the start of the output."""

    name = "generic"
    separators = ",;"

    def probe_boundary(self, view: str, ctx: ProbeContext) -> ProbeResult:
        if len(view) < len(FENCE) and FENCE.startswith(view):
            return MORE
        if view.startswith(FENCE):
            newline = view.find("\n", 0, 16)
            if newline < 0:
                return MORE if len(view) < 16 else NO
            if view[len(FENCE) : newline].strip() not in ("", "json"):
                return NO
            body = view[newline + 1 :].lstrip()
            if not body:
                return MORE
            if body[0] not in "{[":
                return NO
            answer = probe_json_call(body, ctx.tools)
            if answer == "yes":
                return Open(newline + 1, MarkerRegion((FENCE,), JsonBody(preview=False)))
            return answer
        if not view.startswith(("{", "[")):
            return NO
        answer = probe_json_call(view, ctx.tools)
        if answer == "yes":
            return Open(0, JsonRegion(preview=False))
        return answer
