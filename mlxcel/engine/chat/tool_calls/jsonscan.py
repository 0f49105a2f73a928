"""An incremental JSON scanner that finds where a value ends and where its members sit.

Tool-call payloads must keep the model's JSON text verbatim, so this scanner does not build
objects: it records, for the top-level object, each member's key and the character span of
its value, and it reports where the whole value ends. Text may arrive in pieces; every
character is looked at once, so a payload of any size scans in linear time. Bare control
characters inside strings are accepted (models write raw newlines in code arguments).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_SCALAR_START = "-0123456789" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_SCALAR_CHARS = _SCALAR_START + "+."
_MAX_DEPTH = 512


@dataclass
class JsonMember:
    """A member of the top-level object: `value_end` is -1 until the value is complete."""

    key: str
    value_start: int = -1
    value_end: int = -1

    @property
    def complete(self) -> bool:
        return self.value_end >= 0


class JsonScanner:
    """Scan one JSON value fed in pieces; `text` holds everything fed so far.

    `start` is the index of the value's first character, `end` the index just after its
    last one (-1 until known); `failed` is set on the first character that cannot continue
    valid JSON, and scanning stops there (`pos` then points at that character).
    """

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.start = -1
        self.end = -1
        self.failed = False
        self.members: list[JsonMember] = []
        self._stack: list[list[str]] = []  # [kind "{" or "[", what comes next]
        self._top_expect = "value"
        self._string_start = -1
        self._string_is_key = False
        self._escape = False
        self._scalar_start = -1

    @property
    def done(self) -> bool:
        """True once the value is complete."""
        return self.end >= 0

    @property
    def kind(self) -> str:
        """The value's first character ("{", "[", '"', ...) or "" before it starts."""
        return self.text[self.start] if self.start >= 0 else ""

    def feed(self, text: str) -> None:
        """Append `text` and scan as far as it allows."""
        self.text += text
        self._scan()

    def close(self) -> None:
        """End of input: a number or literal running to the end is complete."""
        if self._scalar_start >= 0 and not self.failed:
            self._end_scalar(len(self.text))

    def member(self, *keys: str) -> JsonMember | None:
        """The first top-level member whose key is one of `keys`."""
        for member in self.members:
            if member.key in keys:
                return member
        return None

    def value_text(self, member: JsonMember) -> str:
        """The raw text of a complete member value."""
        return self.text[member.value_start : member.value_end]

    def string_value(self, member: JsonMember | None) -> str | None:
        """A complete string member's decoded value, else None."""
        if member is None or not member.complete or self.text[member.value_start] != '"':
            return None
        return decode_string(self.value_text(member))

    # -- scanning -------------------------------------------------------------------------

    def _scan(self) -> None:
        text = self.text
        n = len(text)
        i = self.pos
        while i < n and self.end < 0 and not self.failed:
            if self._string_start >= 0:
                i = self._scan_string(text, i)
                continue
            if self._scalar_start >= 0:
                if text[i] in _SCALAR_CHARS:
                    i += 1
                    continue
                self._end_scalar(i)
                continue
            char = text[i]
            if char in _WS:
                i += 1
                continue
            if not self._structural(char, i):
                self.failed = True
                break
            i += 1
        self.pos = i

    def _scan_string(self, text: str, i: int) -> int:
        n = len(text)
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
                continue
            quote = text.find('"', i)
            slash = text.find("\\", i, quote if quote >= 0 else n)
            if slash >= 0:
                self._escape = True
                i = slash + 1
                continue
            if quote < 0:
                return n
            self._end_string(quote + 1)
            return quote + 1
        return n

    def _expect(self) -> str:
        return self._stack[-1][1] if self._stack else self._top_expect

    def _set_expect(self, value: str) -> None:
        if self._stack:
            self._stack[-1][1] = value
        else:
            self._top_expect = value

    def _structural(self, char: str, i: int) -> bool:
        expect = self._expect()
        frame = self._stack[-1][0] if self._stack else ""
        if expect in ("value", "value_or_end"):
            if char == "]" and expect == "value_or_end":
                return self._close(i)
            return self._begin_value(char, i)
        if expect in ("key", "key_or_end"):
            if char == '"':
                self._string_start = i
                self._string_is_key = True
                return True
            return char == "}" and expect == "key_or_end" and self._close(i)
        if expect == "colon":
            if char == ":":
                self._set_expect("value")
                return True
            return False
        if expect == "comma_or_end":
            if char == ",":
                self._set_expect("key" if frame == "{" else "value")
                return True
            if (char == "}" and frame == "{") or (char == "]" and frame == "["):
                return self._close(i)
        return False

    def _at_root_object(self) -> bool:
        return len(self._stack) == 1 and self._stack[0][0] == "{"

    def _begin_value(self, char: str, i: int) -> bool:
        if char not in '{["' and char not in _SCALAR_START:
            return False
        if not self._stack:
            self.start = i
        elif self._at_root_object() and self.members:
            self.members[-1].value_start = i
        if char in "{[":
            if len(self._stack) >= _MAX_DEPTH:
                return False
            self._set_expect("comma_or_end")
            self._stack.append([char, "key_or_end" if char == "{" else "value_or_end"])
        elif char == '"':
            self._string_start = i
            self._string_is_key = False
        else:
            self._scalar_start = i
        return True

    def _close(self, i: int) -> bool:
        self._stack.pop()
        self._value_done(i + 1)
        return True

    def _value_done(self, end: int) -> None:
        if not self._stack:
            self.end = end
            self._top_expect = "done"
            return
        self._set_expect("comma_or_end")
        if self._at_root_object() and self.members:
            self.members[-1].value_end = end

    def _end_string(self, end: int) -> None:
        start, self._string_start = self._string_start, -1
        if self._string_is_key:
            key = decode_string(self.text[start:end])
            if key is None:
                self.failed = True
                return
            if self._at_root_object():
                self.members.append(JsonMember(key))
            self._set_expect("colon")
            return
        self._value_done(end)

    def _end_scalar(self, end: int) -> None:
        start, self._scalar_start = self._scalar_start, -1
        token = self.text[start:end]
        try:
            json.loads(token)
        except ValueError:
            self.failed = True
            self.pos = start
            return
        self._value_done(end)


def decode_string(literal: str) -> str | None:
    """Decode a JSON string literal (quotes included); None if it is not one."""
    try:
        value = json.loads(literal, strict=False)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def scan(text: str) -> JsonScanner:
    """Scan a whole text: the scanner after feeding `text` and closing."""
    scanner = JsonScanner()
    scanner.feed(text)
    scanner.close()
    return scanner


def is_json(text: str) -> bool:
    """True if `text` (surrounding whitespace allowed) is exactly one JSON value."""
    scanner = scan(text)
    return scanner.done and not scanner.failed and not text[scanner.end :].strip()


def complete_members(text: str) -> dict[str, object] | None:
    """The members of a JSON object text cut off before its end (a call stopped by
    max_tokens) whose values were generated whole; None if `text` does not start an object.

    A number or literal running to the end of `text` may still have been growing, so it is
    left out, as is a member whose value is unfinished.
    """
    scanner = JsonScanner()
    scanner.feed(text)
    if scanner.kind != "{":
        return None
    members: dict[str, object] = {}
    for member in scanner.members:
        if member.complete:
            try:
                members[member.key] = json.loads(scanner.value_text(member), strict=False)
            except (ValueError, RecursionError):
                break
    return members
