"""Harmony (GPT-OSS): the output is a sequence of messages (line breaks added here)::

    <|channel|>analysis<|message|>User wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A message with a recipient (`to=functions.NAME`, in the header before or after the channel)
is a call: its body is the arguments, verbatim. Otherwise the `analysis` channel is reasoning
and every other channel (`final`, a `commentary` preamble) is content. The generation prompt
ends with `<|start|>assistant`, so the first header has no `<|start|>`. Output that does not
begin with a header is plain content. Calls arrive whole when their message ends.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import (
    Delta,
    StreamFilter,
    ToolCallFormat,
    Tools,
    find_marker,
    partial_suffix_len,
)
from mlxcel.engine.chat.tool_calls.markup import CallSink

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
TERMINATORS = (END, CALL, RETURN, START, CHANNEL)
HEADER_STARTS = (START, CHANNEL, CONSTRAIN, "to=")
_HEADER_LIMIT = 256
_STOP = " \t\r\n<"


def _word_after(text: str, marker: str) -> str:
    at = text.find(marker)
    if at < 0:
        return ""
    rest = text[at + len(marker) :].lstrip()
    end = 0
    while end < len(rest) and rest[end] not in _STOP:
        end += 1
    return rest[:end]


def parse_header(header: str) -> tuple[str, str]:
    """(channel, recipient) of a message header; either may be ""."""
    return _word_after(header, CHANNEL), _word_after(header, "to=")


def call_name(recipient: str) -> str:
    """`functions.get_weather` → `get_weather`; other recipients are kept whole."""
    return recipient[len("functions.") :] if recipient.startswith("functions.") else recipient


class HarmonyFilter:
    """`StreamFilter` for Harmony output: reasoning, content and calls."""

    def __init__(self, tools: Tools | None = None) -> None:
        self._sink = CallSink()
        self._buf = ""
        self._state = "header"
        self._explicit = False  # the header began with <|start|> or <|channel|>
        self._header_prefix = ""  # a consumed <|start|> that began the header
        self._kind = "content"
        self._name = ""
        self._args: list[str] = []
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        if text and not self._finished:
            self._buf += text
            self._run(False)
        return self._sink.take()

    def finish(self) -> list[Delta]:
        if not self._finished:
            self._finished = True
            self._run(True)
        return self._sink.take()

    def _run(self, final: bool) -> None:
        while True:
            if self._state == "header":
                if not self._header(final):
                    return
            elif self._state == "body":
                if not self._body(final):
                    return
            elif not self._plain(final):
                return

    def _header(self, final: bool) -> bool:
        buf = self._buf
        if not self._explicit:
            stripped = buf.lstrip()
            if not stripped:
                if final:
                    self._buf = ""
                return False
            if not stripped.startswith(HEADER_STARTS):
                if not final and any(h.startswith(stripped) for h in HEADER_STARTS):
                    return False
                self._state = "plain"
                return True
            self._explicit = True
        at = buf.find(MESSAGE, 0, _HEADER_LIMIT + len(MESSAGE))
        if at < 0:
            if len(buf) >= _HEADER_LIMIT + len(MESSAGE):  # not a header after all
                self._abandon_header()
                return True
            if final:
                self._buf = ""  # an unfinished header is markup
            return False
        self._header_prefix = ""
        channel, recipient = parse_header(buf[:at])
        if recipient:
            self._kind, self._name, self._args = "call", call_name(recipient), []
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
        self._buf = buf[at + len(MESSAGE) :]
        self._state = "body"
        return True

    def _abandon_header(self) -> None:
        """The header never reached `<|message|>`: its opening is text; read on as plain."""
        buf = self._buf
        opening = next((m for m in (CHANNEL, START, CONSTRAIN) if buf.startswith(m)), buf[:1])
        self._sink.content(self._header_prefix + opening)
        self._buf = buf[len(opening) :]
        self._header_prefix = ""
        self._state = "plain"

    def _body(self, final: bool) -> bool:
        buf = self._buf
        at, marker = find_marker(buf, TERMINATORS)
        if at is None or marker is None:
            cut = len(buf) if final else len(buf) - partial_suffix_len(buf, TERMINATORS)
            self._text(buf[:cut])
            self._buf = buf[cut:]
            if final:
                self._end_message()
            return False
        self._text(buf[:at])
        self._end_message()
        if marker == CHANNEL:
            self._buf = buf[at:]
            self._explicit = True
        else:
            self._buf = buf[at + len(marker) :]
            self._explicit = marker == START
            self._header_prefix = START if marker == START else ""
        self._state = "header"
        return True

    def _plain(self, final: bool) -> bool:
        buf = self._buf
        at, marker = find_marker(buf, (START, CHANNEL))
        if at is None or marker is None:
            cut = len(buf) if final else len(buf) - partial_suffix_len(buf, (START, CHANNEL))
            self._sink.content(buf[:cut])
            self._buf = buf[cut:]
            return False
        self._sink.content(buf[:at])
        self._buf = buf[at + len(START) :] if marker == START else buf[at:]
        self._header_prefix = START if marker == START else ""
        self._explicit = True
        self._state = "header"
        return True

    def _text(self, text: str) -> None:
        if self._kind == "call":
            self._args.append(text)
        elif self._kind == "reasoning":
            self._sink.reasoning(text)
        else:
            self._sink.content(text)

    def _end_message(self) -> None:
        if self._kind == "call":
            arguments = "".join(self._args).strip() or "{}"
            if self._name:
                self._sink.call(self._name, arguments)
            self._args = []
        self._kind = "content"


class HarmonyFormat(ToolCallFormat):
    """GPT-OSS Harmony channels."""

    name = "harmony"

    def stream_filter(self, tools: Tools | None = None) -> StreamFilter:
        return HarmonyFilter(tools)
