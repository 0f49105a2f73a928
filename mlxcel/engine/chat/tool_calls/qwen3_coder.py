"""Qwen3-Coder XML (also Qwen3.5/3.6 checkpoints with its template)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The call opens when `<function=NAME>` is complete; each parameter is sent as soon as its
value ends, typed by the tool schema (one newline on each side of a value is layout). A
`</parameter>` the model forgets is implied by the next tag. A JSON body inside
`<tool_call>` is read as Hermes JSON.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import (
    Tools,
    find_marker,
    partial_suffix_len,
    tool_parameters,
)
from mlxcel.engine.chat.tool_calls.jsoncalls import DEFAULT_KEYS, JsonCalls
from mlxcel.engine.chat.tool_calls.markup import (
    Body,
    CallSink,
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
)
from mlxcel.engine.chat.tool_calls.values import convert_value, member_text

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
_NAME_LIMIT = 256


def _strip_layout(value: str) -> str:
    """Drop the one newline the template puts on each side of a value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class XmlFunctionBody(Body):
    """`<function=...>` elements (or, inside `<tool_call>`, a JSON call) fed in pieces."""

    def __init__(self, tools: Tools | None, *, in_function: bool) -> None:
        self._tools = tools
        self._buf = ""
        self._state = "name" if in_function else "seek"
        self._pieces: list[str] = []
        self._properties: dict[str, object] = {}
        self._key = ""
        self._search = 0  # in a value: where its end tag may start
        self._open = False
        self._seen_function = in_function
        self._json: JsonCalls | None = None

    def consume(self, text: str, sink: CallSink) -> None:
        if self._json is not None:
            self._json.feed(text)
            return
        self._buf += text
        self._run(sink, final=False)

    def close(self, sink: CallSink, complete: bool) -> None:
        if self._json is not None:
            self._json.close()
            return
        self._run(sink, final=True)
        if not complete and self._open:  # cut off: the parameters generated whole, unclosed
            sink.end("".join(self._pieces))
            self._open = False
            return
        if self._state == "value":
            self._param(sink, self._buf)
        if self._open:
            self._end(sink)

    def _run(self, sink: CallSink, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == "seek":
                stripped = buf.lstrip()
                if not self._seen_function and stripped.startswith("{"):
                    self._json = JsonCalls(sink, DEFAULT_KEYS, preview=True, single=False)
                    self._json.feed(stripped)
                    self._buf = ""
                    return
                if not self._advance(buf, (FUNC_OPEN,), final):
                    return
                self._state = "name"
                self._seen_function = True
            elif self._state in ("name", "key"):
                end = min((i for i in (buf.find(">"), buf.find("\n")) if i >= 0), default=-1)
                if end < 0:
                    if len(buf) > _NAME_LIMIT:
                        self._state = "seek" if self._state == "name" else "function"
                        self._buf = ""
                    return
                label = buf[:end].strip()
                self._buf = buf[end + 1 :]
                if self._state == "name":
                    self._begin(sink, label)
                else:
                    self._key = label
                    self._state = "value"
            elif self._state == "function":
                at, marker = find_marker(buf, (PARAM_OPEN, FUNC_CLOSE))
                if at is None or marker is None:
                    self._buf = buf[len(buf) - partial_suffix_len(buf, (PARAM_OPEN, FUNC_CLOSE)) :]
                    return
                self._buf = buf[at + len(marker) :]
                if marker == PARAM_OPEN:
                    self._state = "key"
                else:
                    self._end(sink)
                    self._state = "seek"
            else:  # value
                ends = (PARAM_CLOSE, PARAM_OPEN, FUNC_CLOSE)
                at, marker = find_marker(buf, ends, self._search)
                if at is None or marker is None:
                    self._search = len(buf) - partial_suffix_len(buf, ends)
                    return
                self._search = 0
                self._param(sink, buf[:at])
                self._buf = buf[at + len(marker) :] if marker == PARAM_CLOSE else buf[at:]
                self._state = "function"

    def _advance(self, buf: str, markers: tuple[str, ...], final: bool) -> bool:
        """Skip to just after the next of `markers`; False (keeping a partial tail) if none."""
        at, marker = find_marker(buf, markers)
        if at is None or marker is None:
            self._buf = "" if final else buf[len(buf) - partial_suffix_len(buf, markers) :]
            return False
        self._buf = buf[at + len(marker) :]
        return True

    def _begin(self, sink: CallSink, name: str) -> None:
        if self._open:
            self._end(sink)
        if not name:
            self._state = "seek"
            return
        sink.start(name)
        self._open = True
        self._pieces = []
        self._properties = dict(tool_parameters(self._tools, name))
        self._state = "function"

    def _param(self, sink: CallSink, raw: str) -> None:
        if not self._open:
            return
        value = convert_value(_strip_layout(raw), self._properties.get(self._key))
        piece = ("{" if not self._pieces else ", ") + member_text(self._key, value)
        self._pieces.append(piece)
        sink.fragment(piece)

    def _end(self, sink: CallSink) -> None:
        sink.end("".join(self._pieces) + "}" if self._pieces else "{}")
        self._open = False
        self._pieces = []


class Qwen3CoderFormat(MarkupFormat):
    """`<tool_call><function=...><parameter=...>` XML calls."""

    name = "qwen3_coder"
    streams_arguments = True
    start_markers = (TOOL_OPEN, FUNC_OPEN)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        if marker == TOOL_OPEN:
            return MarkerRegion((TOOL_CLOSE,), XmlFunctionBody(ctx.tools, in_function=False))
        return MarkerRegion((FUNC_CLOSE,), XmlFunctionBody(ctx.tools, in_function=True))
