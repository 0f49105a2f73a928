"""Streamed text → whole sentences, so speech can start before the answer is complete."""

from __future__ import annotations

import re

# A sentence ends at . ! ? … (with closing quotes or brackets) followed by white space, or
# at a line break; a colon or semicolon ends one only when it is already long; the answer's
# first piece also ends at a comma once it is long enough to say (the first audio sooner).
_HARD_END = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
_SOFT_END = re.compile(r"[;:]\s+")
_CLAUSE_END = re.compile(r"[,;:]\s+")
MIN_CHARS = 12
"""A shorter piece waits for more (no "Dr." or "1." spoken on its own)."""
SOFT_CHARS = 120
"""Past this length, a colon or semicolon ends the piece too (long answers start sooner)."""
FIRST_CLAUSE_CHARS = 24
"""The first piece ends at a clause (comma, colon, semicolon) once it is this long: speech
time grows with the piece's length, so a long first sentence would hold the first audio."""


class SentenceChunker:
    """Feed text as it streams; each call returns the sentences it completed."""

    def __init__(
        self,
        min_chars: int = MIN_CHARS,
        soft_chars: int = SOFT_CHARS,
        first_clause_chars: int = FIRST_CLAUSE_CHARS,
    ) -> None:
        self.min_chars = min_chars
        self.soft_chars = soft_chars
        self.first_clause_chars = first_clause_chars
        self._pending = ""
        self._first = True  # no piece out yet

    def feed(self, text: str) -> list[str]:
        """The sentences `text` completes (stripped, never empty)."""
        self._pending += text
        out: list[str] = []
        if self._first:
            clause = self._first_clause()
            if clause:
                out.append(self._pending[:clause].strip())
                self._pending = self._pending[clause:]
        start = 0
        for match in _HARD_END.finditer(self._pending):
            if match.end() - start >= self.min_chars or "\n" in match.group():
                piece = self._pending[start : match.end()].strip()
                if piece:
                    out.append(piece)
                start = match.end()
        rest = self._pending[start:]
        if len(rest) >= self.soft_chars:
            soft = list(_SOFT_END.finditer(rest))[-1:]
            if soft:
                end = soft[0].end()
                out.append(rest[:end].strip())
                rest = rest[end:]
        self._pending = rest
        self._first = self._first and not out
        return out

    def _first_clause(self) -> int:
        """Where the first piece ends at a clause (0: it does not), when that comes before
        its sentence's end and the piece is `first_clause_chars` long."""
        ends = (m.end() for m in _HARD_END.finditer(self._pending))
        sentence = next((e for e in ends if e >= self.min_chars), len(self._pending) + 1)
        for match in _CLAUSE_END.finditer(self._pending):
            if match.end() >= sentence:
                break
            if match.end() >= self.first_clause_chars:
                return match.end()
        return 0

    def finish(self) -> list[str]:
        """What is left once the text ended (one piece, or none)."""
        rest, self._pending = self._pending.strip(), ""
        return [rest] if rest else []
