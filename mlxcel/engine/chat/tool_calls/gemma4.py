"""Google Gemma 4: `<|tool_call>call:NAME{key:value,...}<tool_call|>`.

The body is Gemma's own object syntax, not JSON: keys are bare, strings sit between
`<|"|>` quote tokens, and numbers, true/false/null, nested `{...}` and `[...]` are as in
JSON. It is converted to a JSON arguments string. Calls arrive whole.
"""

from __future__ import annotations

import json
from typing import Any

from mlxcel.engine.chat.tool_calls.markup import (
    CallSink,
    MarkerRegion,
    MarkupFormat,
    ProbeContext,
    Region,
    TextBody,
)
from mlxcel.engine.chat.tool_calls.values import arguments_json

OPEN = "<|tool_call>"
CLOSE = "<tool_call|>"
QUOTE = '<|"|>'
CALL_PREFIX = "call:"
_MAX_DEPTH = 64


class _Syntax(ValueError):
    pass


class GemmaReader:
    """Reads Gemma's call syntax; strings are delimited by `quote`."""

    def __init__(self, text: str, quote: str) -> None:
        self.text = text
        self.quote = quote
        self.at = 0

    def calls(self) -> list[tuple[str, str]]:
        """Every `call:NAME{...}` in the text, in order."""
        found: list[tuple[str, str]] = []
        while True:
            start = self.text.find(CALL_PREFIX, self.at)
            if start < 0:
                return found
            brace = self.text.find("{", start)
            if brace < 0:
                return found
            name = self.text[start + len(CALL_PREFIX) : brace].strip()
            self.at = brace
            try:
                pairs = self._object(0)
            except _Syntax:
                return found
            if name:
                found.append((name, arguments_json(pairs)))

    def _skip(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def _object(self, depth: int) -> list[tuple[str, Any]]:
        if depth > _MAX_DEPTH:
            raise _Syntax("too deep")
        self.at += 1  # "{"
        pairs: list[tuple[str, Any]] = []
        while True:
            self._skip()
            if self.at >= len(self.text):
                raise _Syntax("unterminated object")
            if self.text[self.at] == "}":
                self.at += 1
                return pairs
            key = self._key()
            pairs.append((key, self._value(depth)))
            self._skip()
            if self.text.startswith(",", self.at):
                self.at += 1

    def _key(self) -> str:
        if self.text.startswith(self.quote, self.at):
            return self._string()
        colon = self.text.find(":", self.at)
        if colon < 0:
            raise _Syntax("key without value")
        key = self.text[self.at : colon].strip().strip("\"'")
        self.at = colon + 1
        return key

    def _string(self) -> str:
        start = self.at + len(self.quote)
        end = self.text.find(self.quote, start)
        if end < 0:
            raise _Syntax("unterminated string")
        self.at = end + len(self.quote)
        value = self.text[start:end]
        self._skip()
        if self.text.startswith(":", self.at):  # a quoted key
            self.at += 1
        return value

    def _value(self, depth: int) -> Any:
        self._skip()
        if self.text.startswith(self.quote, self.at):
            start = self.at + len(self.quote)
            end = self.text.find(self.quote, start)
            if end < 0:
                raise _Syntax("unterminated string")
            self.at = end + len(self.quote)
            return self.text[start:end]
        char = self.text[self.at : self.at + 1]
        if char == "{":
            return dict(self._object(depth + 1))
        if char == "[":
            return self._array(depth + 1)
        end = self.at
        while end < len(self.text) and self.text[end] not in ",}]":
            end += 1
        token = self.text[self.at : end].strip()
        self.at = end
        try:
            return json.loads(token)
        except ValueError:
            return token

    def _array(self, depth: int) -> list[Any]:
        if depth > _MAX_DEPTH:
            raise _Syntax("too deep")
        self.at += 1  # "["
        items: list[Any] = []
        while True:
            self._skip()
            if self.at >= len(self.text):
                raise _Syntax("unterminated array")
            if self.text[self.at] == "]":
                self.at += 1
                return items
            items.append(self._value(depth))
            self._skip()
            if self.text.startswith(",", self.at):
                self.at += 1


def report_calls(text: str, quote: str, sink: CallSink) -> None:
    """Report the calls of one block body."""
    for name, arguments in GemmaReader(text, quote).calls():
        sink.call(name, arguments)


class Gemma4Format(MarkupFormat):
    """`<|tool_call>call:name{...}<tool_call|>` blocks."""

    name = "gemma4"
    start_markers = (OPEN,)
    drop_markers = ("<|tool_response>",)

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        return MarkerRegion(
            (CLOSE,), TextBody(lambda text, sink, _: report_calls(text, QUOTE, sink))
        )
