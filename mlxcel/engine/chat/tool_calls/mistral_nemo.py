"""Mistral Nemo / Ministral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

After `[TOOL_CALLS]` comes either a JSON list (or object) of calls, or the bracketed form of
newer Mistral models, `NAME[ARGS]{json}` (optionally `NAME[CALL_ID]id[ARGS]{json}`); both are
read here, and both stream name and arguments while generated. Ids are 9 letters or digits,
the only shape Mistral chat templates accept back.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import nine_char_id
from mlxcel.engine.chat.tool_calls.jsoncalls import DEFAULT_KEYS, JsonCalls, ValueArgs
from mlxcel.engine.chat.tool_calls.markup import CallSink, MarkupFormat, ProbeContext, Region

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME_LIMIT = 256


class MistralRegion(Region):
    """What follows one `[TOOL_CALLS]`: a JSON call value, or `NAME[ARGS]{json}`."""

    def __init__(self) -> None:
        self._text = ""
        self._state = "start"
        self._json: JsonCalls | None = None
        self._args: ValueArgs | None = None
        self._args_at = 0

    def feed(self, text: str, sink: CallSink) -> str | None:
        self._text += text
        if self._state == "start":
            stripped = self._text.lstrip()
            if not stripped:
                return None
            if stripped[0] in "[{":
                self._state = "json"
                self._json = JsonCalls(sink, DEFAULT_KEYS, preview=True, single=True)
                text = self._text
                self._text = ""
            else:
                self._state = "name"
        if self._json is not None:
            self._json.feed(text)
            if self._json.end < 0:
                return None
            self.consumed = self._json.text[: self._json.end]
            return self._json.text[self._json.end :]
        if self._state == "name":
            return self._read_name(sink)
        return self._read_args(text, sink)

    def _read_name(self, sink: CallSink) -> str | None:
        text = self._text
        lead = len(text) - len(text.lstrip())
        limit = lead + _NAME_LIMIT
        space = lead
        while space < len(text) and space < limit and not text[space].isspace():
            space += 1
        at = text.find(ARGS, lead, limit + len(ARGS))
        if at >= 0 and at <= space:
            name = text[lead:at].split(CALL_ID, 1)[0].strip()
            if name:
                sink.start(name)
                self._state = "args"
                self._args = ValueArgs(sink, stream=True)
                self._args_at = at + len(ARGS)
                return self._read_args(text[self._args_at :], sink)
            return self._give_up(at)
        if space < len(text) and space < limit:  # a name has no whitespace
            return self._give_up(space)
        if len(text) >= limit + len(ARGS):
            return self._give_up(limit)
        return None

    def _give_up(self, at: int) -> str:
        """Not a bracketed call: the region ends at `at` without a call."""
        self.consumed = self._text[:at]
        return self._text[at:]

    def _read_args(self, text: str, sink: CallSink) -> str | None:
        assert self._args is not None
        used = self._args.feed(text)
        if used is None:
            return None
        sink.end(self._args.arguments())
        end = len(self._text) - len(text) + used
        self.consumed = self._text[:end]
        return self._text[end:]

    def close(self, sink: CallSink) -> None:
        if self._json is not None:
            self._json.close()
            self.consumed = self._json.text
            return
        if self._args is not None:
            sink.end(self._args.arguments())
        self.consumed = self._text


class MistralNemoFormat(MarkupFormat):
    """`[TOOL_CALLS]` followed by a JSON list of calls."""

    name = "mistral_nemo"
    streams_arguments = True
    start_markers = (MARKER,)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        return MistralRegion()

    def new_call_id(self) -> str:
        return nine_char_id()
