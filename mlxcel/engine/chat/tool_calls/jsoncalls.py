"""Calls written as JSON objects: `{"name": ..., "arguments": {...}}` and its relatives.

`ObjectCall` reads one such object as it is generated. With `preview`, the call opens as soon
as its name is complete and the arguments value streams as raw text while it is scanned, so
the fragments are exactly the model's JSON text. `JsonCalls` reads an object, a list of them,
or (inside a delimited block) several of them. Object-valued arguments are kept verbatim; a
string-valued `arguments` is the string itself; a complete object without arguments (or
with null ones) has "{}". A call cut off before its arguments were generated (max_tokens)
has "" and one cut off inside them has the text generated so far: arguments are never
invented for a call that did not finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.engine.chat.tool_calls.base import Tools, tool_names
from mlxcel.engine.chat.tool_calls.jsonscan import JsonScanner, decode_string, scan
from mlxcel.engine.chat.tool_calls.markup import MORE, NO, Body, CallSink, Region

_WS = " \t\r\n"


@dataclass(frozen=True)
class JsonKeys:
    """Which keys hold a call's name and arguments, and which wrap a list of calls."""

    name: tuple[str, ...] = ("name",)
    arguments: tuple[str, ...] = ("arguments", "parameters")
    wrappers: tuple[str, ...] = ("tool_calls", "tool_call")


DEFAULT_KEYS = JsonKeys()


def arguments_of(scanner: JsonScanner, keys: JsonKeys) -> str:
    """The arguments string of the call object in `scanner` (see module docstring); an
    unfinished value gives the text scanned so far (what a preview has streamed)."""
    member = scanner.member(*keys.arguments)
    if member is None or member.value_start < 0:
        return "{}" if scanner.done else ""
    end = member.value_end if member.complete else scanner.pos
    raw = scanner.text[member.value_start : end]
    if raw.startswith('"') and member.complete:
        decoded = decode_string(raw)
        return raw if decoded is None else decoded
    if raw == "null":
        return "{}"
    return raw


def calls_of(scanner: JsonScanner, keys: JsonKeys, depth: int = 0) -> list[tuple[str, str]]:
    """All (name, arguments) a complete JSON value holds: a call object, a list of them, an
    object wrapping them (`{"tool_calls": [...]}`) or a call nested under "function"."""
    if depth > 3 or not scanner.done:
        return []
    if scanner.kind == "[":
        return [
            call
            for item in split_list(scanner.text[scanner.start : scanner.end])
            for call in calls_of(scan(item), keys, depth + 1)
        ]
    if scanner.kind != "{":
        return []
    name = scanner.string_value(scanner.member(*keys.name))
    if name:
        return [(name, arguments_of(scanner, keys))]
    nested = scanner.member("function")
    if nested is not None and nested.complete:
        inner = scan(scanner.value_text(nested))
        if inner.kind == "{":
            return calls_of(inner, keys, depth + 1)
    wrapper = scanner.member(*keys.wrappers)
    if wrapper is not None and wrapper.complete:
        return calls_of(scan(scanner.value_text(wrapper)), keys, depth + 1)
    return []


def split_list(text: str) -> list[str]:
    """The raw texts of the items of a complete JSON list."""
    items: list[str] = []
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in _WS + ",":
            i += 1
        if i >= len(text) or text[i] == "]":
            return items
        item = JsonScanner()
        item.feed(text[i:])
        item.close()
        if not item.done:
            return items
        items.append(item.text[item.start : item.end])
        i += item.end


class ObjectCall:
    """One call object fed in pieces (see module docstring)."""

    def __init__(self, sink: CallSink, keys: JsonKeys, *, preview: bool) -> None:
        self.scanner = JsonScanner()
        self._sink = sink
        self._keys = keys
        self._preview = preview
        self._started = False
        self._sent = 0

    def feed(self, text: str) -> int | None:
        """Take more text; when the object ends (or breaks), how much of `text` it used."""
        before = len(self.scanner.text)
        self.scanner.feed(text)
        if self._preview:
            self._stream()
        if self.scanner.done:
            return self.scanner.end - before
        if self.scanner.failed:
            return max(self.scanner.pos - before, 0)
        return None

    def finish(self) -> None:
        """Report the call(s); an object that names no call reports nothing."""
        scanner = self.scanner
        if not scanner.done and not scanner.failed:
            scanner.close()
        if self._started:
            self._sink.end(arguments_of(scanner, self._keys))
            return
        if scanner.done:
            calls = calls_of(scanner, self._keys)
        else:
            name = scanner.string_value(scanner.member(*self._keys.name))
            calls = [(name, arguments_of(scanner, self._keys))] if name else []
        for name, arguments in calls:
            self._sink.call(name, arguments)

    def _stream(self) -> None:
        scanner = self.scanner
        if not self._started:
            name = scanner.string_value(scanner.member(*self._keys.name))
            if not name:
                return
            self._sink.start(name)
            self._started = True
        member = scanner.member(*self._keys.arguments)
        if member is None or member.value_start < 0:
            return
        if scanner.text[member.value_start] not in "{[":
            return
        upto = member.value_end if member.complete else scanner.pos
        begin = member.value_start + self._sent
        if upto > begin:
            self._sink.fragment(scanner.text[begin:upto])
            self._sent = upto - member.value_start


class JsonCalls:
    """A JSON call object or list of them; with `single`, exactly one such value, after
    which `end` is set. Otherwise values follow each other (whitespace, "," or ";" between)
    until the caller stops feeding. Invalid JSON ends a `single` value where it breaks and
    makes the rest of a multi-value text ignored."""

    def __init__(self, sink: CallSink, keys: JsonKeys, *, preview: bool, single: bool) -> None:
        self.text = ""
        self.end = -1
        self.broken = False
        self._sink = sink
        self._keys = keys
        self._preview = preview
        self._single = single
        self._i = 0
        self._state = "value"
        self._object: ObjectCall | None = None
        self._in_list = False

    def feed(self, text: str) -> None:
        """Take more text."""
        self.text += text
        self._run()

    def close(self) -> None:
        """No more text: report a call still open."""
        if self._object is not None:
            self._object.finish()
            self._object = None

    def _run(self) -> None:
        text = self.text
        while self._i < len(text) and self.end < 0 and not self.broken:
            if self._object is not None:
                used = self._object.feed(text[self._i :])
                if used is None:
                    self._i = len(text)
                    return
                self._i += used
                failed = not self._object.scanner.done
                self._object.finish()
                self._object = None
                if failed:
                    self._break()
                elif self._in_list:
                    self._state = "list_next"
                else:
                    self._value_done()
                continue
            char = text[self._i]
            if char in _WS or (char in ",;" and self._state == "value" and not self._single):
                self._i += 1
                continue
            if self._state in ("value", "list_value") and char == "{":
                self._object = ObjectCall(self._sink, self._keys, preview=self._preview)
            elif self._state == "value" and char == "[":
                self._in_list = True
                self._state = "list_value"
                self._i += 1
            elif self._state in ("list_value", "list_next") and char == "]":
                self._i += 1
                self._in_list = False
                self._value_done()
            elif self._state == "list_next" and char == ",":
                self._state = "list_value"
                self._i += 1
            else:
                self._break()

    def _value_done(self) -> None:
        self._state = "value"
        if self._single:
            self.end = self._i

    def _break(self) -> None:
        if self._single:
            self.end = self._i
        else:
            self.broken = True


class JsonRegion(Region):
    """A region that is exactly one JSON call value (no end marker)."""

    def __init__(self, keys: JsonKeys = DEFAULT_KEYS, *, preview: bool) -> None:
        self._keys = keys
        self._preview = preview
        self._calls: JsonCalls | None = None

    def feed(self, text: str, sink: CallSink) -> str | None:
        if self._calls is None:
            self._calls = JsonCalls(sink, self._keys, preview=self._preview, single=True)
        calls = self._calls
        calls.feed(text)
        if calls.end < 0:
            return None
        self.consumed = calls.text[: calls.end]
        return calls.text[calls.end :]

    def close(self, sink: CallSink) -> None:
        if self._calls is not None:
            self._calls.close()
            self.consumed = self._calls.text


class JsonBody(Body):
    """The JSON between two markers: one or more call objects or lists."""

    def __init__(self, keys: JsonKeys = DEFAULT_KEYS, *, preview: bool) -> None:
        self._keys = keys
        self._preview = preview
        self._calls: JsonCalls | None = None

    def consume(self, text: str, sink: CallSink) -> None:
        if self._calls is None:
            self._calls = JsonCalls(sink, self._keys, preview=self._preview, single=False)
        self._calls.feed(text)

    def close(self, sink: CallSink, complete: bool) -> None:
        if self._calls is not None:
            self._calls.close()


class ValueArgs:
    """A bare JSON value that is a call's whole arguments (`[ARGS]{...}`, `Action Input:`).

    The call is opened by the caller; with `stream` the value's text is sent as scanned.
    """

    def __init__(self, sink: CallSink, *, stream: bool) -> None:
        self.scanner = JsonScanner()
        self._sink = sink
        self._stream = stream
        self._sent = 0

    def feed(self, text: str) -> int | None:
        """Take more text; when the value ends (or breaks), how much of `text` it used."""
        before = len(self.scanner.text)
        self.scanner.feed(text)
        scanner = self.scanner
        if self._stream and scanner.start >= 0 and scanner.kind in "{[":
            upto = scanner.end if scanner.done else scanner.pos
            if upto > scanner.start + self._sent:
                self._sink.fragment(scanner.text[scanner.start + self._sent : upto])
                self._sent = upto - scanner.start
        if scanner.done:
            return scanner.end - before
        if scanner.failed:
            return max(scanner.pos - before, 0)
        return None

    def arguments(self) -> str:
        """The final arguments text (what has been seen, if the value never completed; ""
        when none was generated)."""
        scanner = self.scanner
        if scanner.start < 0:
            return ""
        raw = scanner.text[scanner.start : scanner.end if scanner.done else scanner.pos]
        if scanner.kind in "{[":
            return raw
        if scanner.kind == '"' and scanner.done:
            decoded = decode_string(raw)
            return raw if decoded is None else decoded
        return raw.strip()


def probe_json_call(view: str, tools: Tools | None, keys: JsonKeys = DEFAULT_KEYS) -> str:
    """Does `view` (starting at "{" or "[") begin a JSON call? "yes", NO or MORE.

    A call object's first key must be a name key (its value a string naming a declared tool
    when tools are given), followed by an arguments key or the object's end; or a wrapper
    key; `"type": "function"` may come first. A list must start with such an object.
    """
    text = view
    if text.startswith("["):
        rest = text[1:].lstrip()
        if not rest:
            return MORE
        if rest[0] != "{":
            return NO
        text = rest
    scanner = JsonScanner()
    scanner.feed(text)
    members = scanner.members
    names = tool_names(tools)
    index = 0
    if members and members[0].key == "type":
        first = members[0]
        if not first.complete:
            return NO if scanner.failed else MORE
        if scanner.string_value(first) != "function":
            return NO
        index = 1
    if len(members) <= index:
        return NO if scanner.failed or scanner.done else MORE
    member = members[index]
    if member.key in keys.wrappers:
        return "yes"
    if member.key not in keys.name:
        return NO
    if not member.complete:
        return NO if scanner.failed else MORE
    name = scanner.string_value(member)
    if not name or (names and name not in names):
        return NO
    if len(members) > index + 1:
        return "yes" if members[index + 1].key in keys.arguments else NO
    if scanner.done:
        return "yes" if names else NO
    return NO if scanner.failed else MORE


def strip_json_fence(text: str) -> str:
    """`text` without a surrounding Markdown code fence (```json ... ```), if it has one."""
    body = text.strip()
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        body = body[3:-3]
        newline = body.find("\n")
        if newline >= 0 and body[:newline].strip().isalnum():
            body = body[newline + 1 :]
        return body.strip()
    return body


def parse_calls_text(text: str, keys: JsonKeys = DEFAULT_KEYS) -> list[tuple[str, str]]:
    """The calls in a complete JSON text (object, list or wrapper); [] if it holds none."""
    return calls_of(scan(strip_json_fence(text)), keys)
