"""Cohere Command R / R7B.

Three shapes are read:

* `Action: NAME` on its own line, then `Action Input: {json}` (the JSON is the arguments);
* `Action: ```json [{"tool_name": ..., "parameters": {...}}, ...] ```` (Command R/R+);
* `<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ..., "parameters": {...}}]<|END_ACTION|>`
  (Command R7B), whose answer text is wrapped in `<|START_RESPONSE|>`/`<|END_RESPONSE|>`
  markers that are removed from the content.

`Action:` counts only at the start of a line and only when one of the first two shapes
follows; otherwise it is text.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.functionary_v31 import NAME_CHARS
from mlxcel.engine.chat.tool_calls.jsoncalls import JsonBody, JsonKeys, ValueArgs
from mlxcel.engine.chat.tool_calls.markup import (
    MORE,
    NO,
    CallSink,
    MarkerRegion,
    MarkupFormat,
    Open,
    ProbeContext,
    ProbeResult,
    Region,
)

ACTION = "Action:"
ACTION_INPUT = "Action Input:"
FENCE = "```"
START_ACTION = "<|START_ACTION|>"
END_ACTION = "<|END_ACTION|>"
RESPONSE_MARKERS = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
KEYS = JsonKeys(name=("tool_name", "name"), arguments=("parameters", "arguments"))


class ActionInputRegion(Region):
    """The JSON value after `Action Input:`; it is the arguments of `name`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._args: ValueArgs | None = None
        self._text = ""

    def feed(self, text: str, sink: CallSink) -> str | None:
        self._text += text
        if self._args is None:
            self._args = ValueArgs(sink, stream=False)
        used = self._args.feed(text)
        if used is None:
            return None
        end = len(self._text) - len(text) + used
        if self._args.scanner.done:
            sink.call(self._name, self._args.arguments())
        self.consumed = self._text[:end]
        return self._text[end:]

    def close(self, sink: CallSink) -> None:
        if self._args is not None and self._args.scanner.start >= 0:
            sink.call(self._name, self._args.arguments())
        self.consumed = self._text


def _skip_spaces(view: str, at: int) -> int:
    while at < len(view) and view[at] in " \t":
        at += 1
    return at


def probe_action(view: str) -> ProbeResult:
    """`view` starts with `Action:`: which shape follows, if any."""
    at = _skip_spaces(view, len(ACTION))
    if at == len(view):
        return MORE
    if view[at] == "`":
        if len(view) < at + len(FENCE):
            return MORE if FENCE.startswith(view[at:]) else NO
        if not view.startswith(FENCE, at):
            return NO
        newline = view.find("\n", at)
        if newline < 0:
            return MORE
        language = view[at + len(FENCE) : newline].strip()
        if language not in ("", "json"):
            return NO
        return Open(newline + 1, MarkerRegion((FENCE,), JsonBody(KEYS, preview=False)))
    start = at
    while at < len(view) and view[at] in NAME_CHARS:
        at += 1
    name = view[start:at]
    at = _skip_spaces(view, at)
    if at == len(view):
        return MORE
    if not name or view[at] not in "\r\n":
        return NO
    while at < len(view) and view[at] in " \t\r\n":
        at += 1
    rest = view[at : at + len(ACTION_INPUT)]
    if len(rest) < len(ACTION_INPUT):
        return MORE if ACTION_INPUT.startswith(rest) else NO
    if rest != ACTION_INPUT:
        return NO
    return Open(at + len(ACTION_INPUT), ActionInputRegion(name))


class CommandRFormat(MarkupFormat):
    """Command R `Action:` blocks and R7B `<|START_ACTION|>` lists."""

    name = "command_r"
    start_markers = (START_ACTION, ACTION)
    drop_markers = RESPONSE_MARKERS

    def probe(self, marker: str, view: str, ctx: ProbeContext) -> ProbeResult:
        if marker == START_ACTION:
            return Open(len(marker), MarkerRegion((END_ACTION,), JsonBody(KEYS, preview=False)))
        if not ctx.line_start:
            return NO
        return probe_action(view)
