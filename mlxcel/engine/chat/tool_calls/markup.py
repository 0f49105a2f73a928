"""The streaming engine shared by the tag- and marker-based formats.

Text is scanned in two modes. In content mode the filter looks for the format's literal
markers (and, where a format allows it, a call that starts bare at the start of the output or
right after another call); text before a marker is content, and a tail that may still grow
into a marker is held. When a marker opens a call, a `Region` takes the following text until
the call ends; it reports calls to a `CallSink`, then hands back whatever text followed it.

Rules every format gets from here:

* whitespace right before a call, between calls and after the last call is not content;
* a region that ends without producing a call releases its whole text as content;
* every decision depends only on the text seen so far (a probe sees a window of fixed size),
  so the result never depends on how the text was split.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    ReasoningDelta,
    StreamFilter,
    ToolCallDelta,
    ToolCallFormat,
    Tools,
    find_marker,
    may_grow_into,
    partial_suffix_len,
    trailing_space_len,
)

log = logging.getLogger(__name__)


class CallSink:
    """Collects the deltas of one stream; numbers the calls in order."""

    def __init__(self) -> None:
        self.count = 0
        self._deltas: list[Delta] = []
        self._open: int | None = None
        self._sent: list[str] = []

    @property
    def open(self) -> bool:
        """True while a started call has not been ended."""
        return self._open is not None

    def content(self, text: str) -> None:
        """Plain content."""
        if text:
            self._deltas.append(ContentDelta(text))

    def reasoning(self, text: str) -> None:
        """Reasoning text."""
        if text:
            self._deltas.append(ReasoningDelta(text))

    def start(self, name: str, call_id: str | None = None) -> None:
        """Open a new call (its name is final from now on)."""
        if self._open is not None:
            self.end("".join(self._sent))
        self._open = self.count
        self.count += 1
        self._sent = []
        self._deltas.append(ToolCallDelta(self._open, id=call_id, name=name))

    def fragment(self, text: str) -> None:
        """A piece of the open call's arguments."""
        if text and self._open is not None:
            self._sent.append(text)
            self._deltas.append(ToolCallDelta(self._open, arguments_fragment=text))

    def end(self, arguments: str) -> None:
        """Close the open call with its final `arguments`; sends what is still missing."""
        if self._open is None:
            return
        sent = "".join(self._sent)
        if arguments.startswith(sent):
            self.fragment(arguments[len(sent) :])
        else:  # the formats never do this; the assembler would report it
            log.debug("call %d: final arguments do not extend the streamed ones", self._open)
        self._open = None

    def call(self, name: str, arguments: str, call_id: str | None = None) -> None:
        """A whole call at once: one start delta, one arguments delta."""
        self.start(name, call_id)
        self.end(arguments)

    def take(self) -> list[Delta]:
        """The deltas collected since the last take."""
        out, self._deltas = self._deltas, []
        return out


class Region(ABC):
    """The text of a call, from right after its opening marker to its end."""

    #: The region's own text (end marker included) once it has ended.
    consumed: str = ""

    @abstractmethod
    def feed(self, text: str, sink: CallSink) -> str | None:
        """Take more text; None while the region continues, else the text that follows it."""

    @abstractmethod
    def close(self, sink: CallSink) -> None:
        """Generation ended inside the region: resolve what it has."""


class Body(ABC):
    """What a `MarkerRegion` holds between its markers, fed in safe pieces."""

    @abstractmethod
    def consume(self, text: str, sink: CallSink) -> None:
        """More body text (never part of the end marker)."""

    @abstractmethod
    def close(self, sink: CallSink, complete: bool) -> None:
        """The body is over: `complete` if its end marker was seen."""


class TextBody(Body):
    """A body parsed whole when it ends: `parse(text, sink, complete)` reports the calls."""

    def __init__(self, parse: Callable[[str, CallSink, bool], None]) -> None:
        self._parse = parse
        self._parts: list[str] = []

    def consume(self, text: str, sink: CallSink) -> None:
        self._parts.append(text)

    def close(self, sink: CallSink, complete: bool) -> None:
        self._parse("".join(self._parts), sink, complete)


class MarkerRegion(Region):
    """A region that ends at the first of `ends`; with `keep_end` the end marker is left
    for content mode (it opens the next call)."""

    def __init__(self, ends: Sequence[str], body: Body, *, keep_end: bool = False) -> None:
        self._ends = tuple(ends)
        self._body = body
        self._keep_end = keep_end
        self._given: list[str] = []  # text handed to the body
        self._tail = ""  # text that may be the start of an end marker

    def feed(self, text: str, sink: CallSink) -> str | None:
        tail = self._tail + text
        at, marker = find_marker(tail, self._ends)
        if at is not None and marker is not None:
            self._give(tail[:at], sink)
            self._body.close(sink, True)
            stop = at if self._keep_end else at + len(marker)
            self.consumed = "".join(self._given) + tail[at:stop]
            return tail[stop:]
        safe = len(tail) - partial_suffix_len(tail, self._ends)
        self._give(tail[:safe], sink)
        self._tail = tail[safe:]
        return None

    def close(self, sink: CallSink) -> None:
        self._give(self._tail, sink)
        self._tail = ""
        self._body.close(sink, False)
        self.consumed = "".join(self._given)

    def _give(self, text: str, sink: CallSink) -> None:
        if text:
            self._given.append(text)
            self._body.consume(text, sink)


# -- probes -------------------------------------------------------------------------------

#: Probe answers: not a call here / cannot tell yet.
NO = "no"
MORE = "more"


@dataclass(frozen=True)
class Drop:
    """Remove `length` characters of markup here and stay in content mode."""

    length: int


@dataclass(frozen=True)
class Open:
    """A call starts here: `length` characters of opening markup, then `region`."""

    length: int
    region: Region


ProbeResult = str | Drop | Open


@dataclass(frozen=True)
class ProbeContext:
    """What a probe may know: `complete` means no more text will arrive in its window."""

    tools: Tools | None
    line_start: bool
    complete: bool


class MarkupFormat(ToolCallFormat):
    """A format driven by `MarkupFilter`. Subclasses list their markers and open regions."""

    #: Literal markers that may open a call (each is checked by `probe`).
    start_markers: tuple[str, ...] = ()
    #: Literal markup removed from content wherever it appears.
    drop_markers: tuple[str, ...] = ()
    #: Characters skipped (like whitespace) between calls.
    separators: str = ""
    #: How many characters a probe may look at.
    probe_window: int = 512

    def probe(self, marker: str, view: str, ctx: ProbeContext) -> ProbeResult:
        """At a start marker (`view` starts with it): open a region, drop it, or not a call."""
        return Open(len(marker), self.open_region(marker, ctx))

    def open_region(self, marker: str, ctx: ProbeContext) -> Region:
        """The region that follows `marker`."""
        raise NotImplementedError

    def probe_boundary(self, view: str, ctx: ProbeContext) -> ProbeResult:
        """At the output start or right after a call (`view` starts at a non-space
        character): may a call start here without a marker? Default: no."""
        return NO

    def stream_filter(self, tools: Tools | None = None) -> StreamFilter:
        return MarkupFilter(self, tools)


class MarkupFilter:
    """`StreamFilter` for a `MarkupFormat`."""

    def __init__(self, fmt: MarkupFormat, tools: Tools | None) -> None:
        self._fmt = fmt
        self._tools = tools
        self._sink = CallSink()
        self._markers = fmt.start_markers + fmt.drop_markers
        self._drop = frozenset(fmt.drop_markers)
        self._buf = ""
        self._region: Region | None = None
        self._opener = ""
        self._region_space = ""
        self._region_calls = 0
        self._boundary = True
        self._after_call = False
        self._prev = "\n"
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

    # -- driving --------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            region = self._region
            if region is not None:
                text, self._buf = self._buf, ""
                rest = region.feed(text, self._sink)
                if rest is None:
                    if not final:
                        return
                    region.close(self._sink)
                    rest = ""
                self._end_region(region, rest)
                continue
            if not self._scan(final):
                return

    def _end_region(self, region: Region, rest: str) -> None:
        self._region = None
        if self._sink.count > self._region_calls:
            self._after_call = True
            self._boundary = True
            self._prev = "\n"
        else:
            raw = self._region_space + self._opener + region.consumed
            self._emit(raw)
            self._boundary = False
        self._region_space = self._opener = ""
        self._buf = rest + self._buf

    def _open(self, result: Open, buf: str, at: int, space: int) -> None:
        self._emit(buf[: at - space])
        self._region_space = buf[at - space : at]
        self._opener = buf[at : at + result.length]
        self._region = result.region
        self._region_calls = self._sink.count
        self._buf = buf[at + result.length :]

    def _emit(self, text: str) -> None:
        if text:
            self._sink.content(text)
            self._prev = text[-1]

    def _ctx(self, buf: str, at: int, final: bool) -> ProbeContext:
        before = buf[at - 1] if at > 0 else self._prev
        complete = final or len(buf) - at >= self._fmt.probe_window
        return ProbeContext(self._tools, before == "\n", complete)

    def _probe(self, result: ProbeResult, ctx: ProbeContext) -> ProbeResult:
        return NO if result == MORE and ctx.complete else result

    def _scan(self, final: bool) -> bool:
        """Content mode over the buffer; True if a region was opened."""
        buf = self._buf
        window = self._fmt.probe_window
        if self._after_call:
            skip = 0
            seps = self._fmt.separators
            while skip < len(buf) and (buf[skip].isspace() or buf[skip] in seps):
                skip += 1
            buf = buf[skip:]
            if not buf:
                self._buf = ""
                return False
            self._after_call = False
        if self._boundary:
            first = len(buf) - len(buf.lstrip())
            if first == len(buf):
                if final:
                    self._emit_final(buf)
                else:
                    self._buf = buf
                return False
            ctx = self._ctx(buf, first, final)
            result = self._probe(self._fmt.probe_boundary(buf[first : first + window], ctx), ctx)
            if result == MORE:
                self._buf = buf
                return False
            if isinstance(result, Open):
                self._open(result, buf, first, first)
                return True
            if isinstance(result, Drop):
                buf = buf[:first] + buf[first + result.length :]
            self._boundary = False
        pos = 0
        while True:
            at, marker = find_marker(buf, self._markers, pos)
            if at is None or marker is None:
                break
            if not final and may_grow_into(buf[at:], self._markers, marker):
                self._hold_from(buf, at)
                return False
            if marker in self._drop:
                buf = buf[:at] + buf[at + len(marker) :]
                pos = at
                continue
            ctx = self._ctx(buf, at, final)
            result = self._probe(self._fmt.probe(marker, buf[at : at + window], ctx), ctx)
            if result == MORE:
                self._hold_from(buf, at)
                return False
            if isinstance(result, Open):
                self._open(result, buf, at, trailing_space_len(buf, at))
                return True
            if isinstance(result, Drop):
                buf = buf[:at] + buf[at + result.length :]
                pos = at
                continue
            pos = at + 1
        if final:
            self._emit_final(buf)
            return False
        keep = partial_suffix_len(buf, self._markers, pos)
        self._hold_from(buf, len(buf) - keep)
        return False

    def _hold_from(self, buf: str, at: int) -> None:
        """Emit the text before `at` except its trailing whitespace; hold the rest."""
        cut = at - trailing_space_len(buf, at)
        self._emit(buf[:cut])
        self._buf = buf[cut:]

    def _emit_final(self, buf: str) -> None:
        """End of generation in content mode: trailing whitespace goes only if calls were made."""
        self._emit(buf.rstrip() if self._sink.count else buf)
        self._buf = ""
