"""The tool-call format interface: parse results, stream deltas and the holdback helpers.

A format turns a model's generated text into plain content, tool calls and (Harmony only)
reasoning. It works two ways that always agree:

* `parse(text, tools)` on the whole output, and
* `stream_filter(tools)`, fed the text as it is generated. The filter never lets markup or
  a call's payload out as content; text that only partly matches a delimiter is held until
  it is decided, then released as content if it was not one.

The stream's deltas, collected with `collect`, give exactly what `parse` gives for the same
text, however the text was split.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

#: A request's `tools` list, as the OpenAI API gives it.
Tools = Sequence[Mapping[str, Any]]

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `arguments` is JSON text; `id` is the model's own id, if it wrote one."""

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ParseResult:
    """A whole output split into content, calls and (where the format has one) reasoning."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None


@dataclass(frozen=True)
class ContentDelta:
    """Plain text for `delta.content`."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Text for `delta.reasoning_content`."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: the delta that opens a call carries its `name` (and the
    model's own `id`, if any); later ones carry `arguments_fragment`. The fragments of a call
    concatenate to its final arguments string."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments_fragment: str = ""


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


@dataclass(frozen=True)
class ToolCallStart:
    """Output event: call `index` opens, with its id (kept for the whole answer) and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """Output event: more argument text of call `index` (fragments concatenate)."""

    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Output event: call `index` is complete (sent once per call, when the output ends)."""

    index: int


OutputEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArguments | ToolCallEnd
"""What a chat answer's output stream yields: typed, no wire shape (each API encodes it)."""


class StreamFilter(Protocol):
    """Incremental parser: `feed` each new piece of text, `finish` once at the end."""

    def feed(self, text: str) -> list[Delta]:
        """Deltas decided by the text so far (held text stays inside)."""
        ...

    def finish(self) -> list[Delta]:
        """End of generation: release or resolve everything still held."""
        ...


@dataclass
class _CallAccumulator:
    name: str
    id: str | None
    fragments: list[str] = field(default_factory=list)


def collect(deltas: Iterable[Delta]) -> ParseResult:
    """Fold a stream's deltas into the `ParseResult` they describe."""
    content: list[str] = []
    reasoning: list[str] | None = None
    calls: dict[int, _CallAccumulator] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif isinstance(delta, ReasoningDelta):
            reasoning = [] if reasoning is None else reasoning
            reasoning.append(delta.text)
        else:
            call = calls.get(delta.index)
            if call is None:
                call = calls[delta.index] = _CallAccumulator(delta.name or "", delta.id)
            call.fragments.append(delta.arguments_fragment)
    return ParseResult(
        content="".join(content),
        calls=tuple(ToolCall(c.name, "".join(c.fragments), c.id) for _, c in sorted(calls.items())),
        reasoning=None if reasoning is None else "".join(reasoning),
    )


class ToolCallFormat(ABC):
    """One wire format for tool calls. Subclasses set `name`, and `streams_arguments` when
    names and arguments stream while generated (otherwise each call arrives whole)."""

    name: str = ""
    streams_arguments: bool = False

    @abstractmethod
    def stream_filter(self, tools: Tools | None = None) -> StreamFilter:
        """A fresh incremental filter for one generation."""

    def parse(self, text: str, tools: Tools | None = None) -> ParseResult:
        """Split a whole output; the same result the stream filter gives for any split."""
        stream = self.stream_filter(tools)
        return collect([*stream.feed(text), *stream.finish()])

    def new_call_id(self) -> str:
        """A fresh id for a call this format produced (`call_...` unless overridden)."""
        return new_call_id()


def new_call_id() -> str:
    """A fresh call id: `call_` and 24 letters or digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def nine_char_id() -> str:
    """A 9-character alphanumeric id (Mistral chat templates refuse any other shape)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


# -- holdback helpers ---------------------------------------------------------------------


def partial_suffix_len(text: str, markers: Iterable[str], start: int = 0) -> int:
    """Length of the longest suffix of `text[start:]` that is a proper prefix of a marker.

    That suffix may still become a marker once more text arrives, so it must be held.
    """
    best = 0
    limit = len(text) - start
    for marker in markers:
        longest = min(len(marker) - 1, limit)
        if longest <= best:
            continue
        tail = text[len(text) - longest :]
        # A held tail starts with the marker's first character; try the earliest such start.
        at = tail.find(marker[0])
        while at >= 0 and len(tail) - at > best:
            if marker.startswith(tail[at:]):
                best = len(tail) - at
                break
            at = tail.find(marker[0], at + 1)
    return best


def find_marker(
    text: str, markers: Sequence[str], start: int = 0
) -> tuple[int, str] | tuple[None, None]:
    """The earliest full occurrence of any marker at or after `start` (longest on a tie)."""
    best_at: int | None = None
    best: str | None = None
    for marker in markers:
        if not marker:
            continue
        at = text.find(marker, start)
        if at < 0:
            continue
        if best_at is None or at < best_at or (at == best_at and len(marker) > len(best or "")):
            best_at, best = at, marker
    if best_at is None or best is None:
        return None, None
    return best_at, best


def may_grow_into(rest: str, markers: Iterable[str], matched: str) -> bool:
    """True if `rest` (the text from a match onward) is a proper prefix of a marker longer
    than `matched`, so a longer marker may still match at the same place."""
    return any(len(m) > len(matched) and len(rest) < len(m) and m.startswith(rest) for m in markers)


def trailing_space_len(text: str, end: int | None = None) -> int:
    """Number of whitespace characters right before `end` (default: the end of `text`)."""
    stop = len(text) if end is None else end
    at = stop
    while at > 0 and text[at - 1].isspace():
        at -= 1
    return stop - at


def tool_parameters(tools: Tools | None, name: str) -> Mapping[str, Any]:
    """The JSON-schema `properties` of tool `name`, or {} if it is not declared."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            if isinstance(parameters, Mapping):
                properties = parameters.get("properties")
                if isinstance(properties, Mapping):
                    return properties
            return {}
    return {}


def tool_names(tools: Tools | None) -> frozenset[str]:
    """The names declared in `tools`."""
    names = set()
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)
