"""Stop strings matched across token boundaries of streamed text."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filter incrementally decoded text so that no stop string is ever emitted.

    `feed(delta)` returns the text that is safe to emit now and whether a stop string was
    found. Text that could be the start of a stop string is held back until it is known
    not to be one. On a match only the text before the stop string is emitted (as OpenAI and
    llama-server do) and the matcher is done: later feeds return `("", True)`.

    The result does not depend on how the text is split: generation stops at the first
    position where some stop string ends; if several end there, the longest wins.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        """True once a stop string has been found."""
        return self.matched is not None

    @property
    def held(self) -> str:
        """The text held back because it may start a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add `delta`; return (text safe to emit, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        text = self._held + delta
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                candidate = (at + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is not None:
            end, neg_length, stop = best
            self.matched = stop
            self._held = ""
            return text[: end + neg_length], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """End of generation: release the held text ("" after a match)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
