"""Streamed text → whole sentences, so speech can start before the answer is complete."""

from __future__ import annotations

import re

# A sentence ends at . ! ? … (with closing quotes or brackets) followed by white space, or
# at a line break; a colon or semicolon ends one only when it is already long.
_HARD_END = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
_SOFT_END = re.compile(r"[;:]\s+")
MIN_CHARS = 12
"""A shorter piece waits for more (no "Dr." or "1." spoken on its own)."""
SOFT_CHARS = 120
"""Past this length, a colon or semicolon ends the piece too (long answers start sooner)."""


class SentenceChunker:
    """Feed text as it streams; each call returns the sentences it completed."""

    def __init__(self, min_chars: int = MIN_CHARS, soft_chars: int = SOFT_CHARS) -> None:
        self.min_chars = min_chars
        self.soft_chars = soft_chars
        self._pending = ""

    def feed(self, text: str) -> list[str]:
        """The sentences `text` completes (stripped, never empty)."""
        self._pending += text
        out: list[str] = []
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
        return out

    def finish(self) -> list[str]:
        """What is left once the text ended (one piece, or none)."""
        rest, self._pending = self._pending.strip(), ""
        return [rest] if rest else []
