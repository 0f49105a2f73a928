"""Long plain strings lifted out of a JSON body before it is parsed.

A picture sent as a data URI is megabytes of base64 in one JSON string. `json.loads` holds
the GIL for its whole scan (a few ms for a 1280x720 picture, more on a loaded machine), so
parsing such a body stalls the event loop, whatever thread parses it. `lift_blobs` cuts
each long string literal that needs no decoding (printable ASCII, no escape) out of the raw
bytes, checking it in pieces that each hold the GIL well under a millisecond, and puts a
short placeholder in its place; the parser then reads a body of a few kilobytes, and
`restore_blobs` puts the strings back.

The value is the one `json.loads` gives for the whole body, and a body it refuses is still
refused: a lifted region holds no quote, backslash or control character and neither does
its placeholder, so the parser tokenizes the rest of the body exactly as before; quotes are
paired the way a JSON lexer pairs them (outside a string a quote opens one, inside one a
quote after an odd run of backslashes is escaped). Placeholders carry a random nonce, so no
client string is taken for one.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

BLOB_MIN = 1 << 16
"""Characters a string literal needs to be lifted (shorter ones cost the parser nothing)."""

CHECK_PIECE = 1 << 18
"""Bytes checked in one call (one GIL hold) while a string is lifted."""

MAX_QUOTES = 8192
"""Quotes walked in one body at most; the rest of a body with more is parsed as it is."""

_PRINTABLE = bytes(range(0x20, 0x7F))
_QUOTE, _BACKSLASH = b'"', b"\\"


def lift_blobs(raw: bytes) -> tuple[bytes, dict[str, str]]:
    """(`raw` with every long plain string literal replaced by a placeholder, placeholder
    -> the string it replaces). A body that is not UTF-8 comes back as it is."""
    if len(raw) < BLOB_MIN or json.detect_encoding(raw) != "utf-8":
        return raw, {}
    nonce = secrets.token_hex(8)
    blobs: dict[str, str] = {}
    pieces: list[bytes] = []
    copied = 0  # raw[:copied] is in pieces
    for start, end in _string_literals(raw):
        if end - start - 1 < BLOB_MIN or raw.find(_BACKSLASH, start + 1, end) >= 0:
            continue
        text = _plain_text(raw, start + 1, end)
        if text is None:
            continue
        key = f"mlxcel-blob-{nonce}-{len(blobs)}"
        blobs[key] = text
        pieces += (raw[copied : start + 1], key.encode())
        copied = end
    if not blobs:
        return raw, {}
    pieces.append(raw[copied:])
    return b"".join(pieces), blobs


def restore_blobs(value: Any, blobs: dict[str, str]) -> Any:
    """`value` (parsed from `lift_blobs`'s body) with each placeholder, a string value or
    an object key, replaced by the string it stands for (containers changed in place)."""
    if not blobs:
        return value
    if type(value) is str:
        return blobs.get(value, value)
    left = len(blobs)
    stack = [value]
    while stack and left:
        node = stack.pop()
        if type(node) is dict:
            if any(key in blobs for key in node):
                items = list(node.items())
                node.clear()
                for key, child in items:
                    left -= key in blobs
                    node[blobs.get(key, key)] = child
            pairs: Any = list(node.items())
        elif type(node) is list:
            pairs = enumerate(node)
        else:
            continue
        for index, child in pairs:
            kind = type(child)
            if kind is str and child in blobs:
                node[index] = blobs[child]
                left -= 1
            elif kind is dict or kind is list:
                stack.append(child)
    return value


def _string_literals(raw: bytes) -> Iterator[tuple[int, int]]:
    """(opening quote, closing quote) of each string literal of `raw`, in order, while the
    quotes walked stay within `MAX_QUOTES`; stops at an unterminated literal."""
    budget = MAX_QUOTES
    pos = 0
    while budget > 0:
        start = raw.find(_QUOTE, pos)
        if start < 0:
            return
        budget -= 1
        scan = start + 1
        while True:
            end = raw.find(_QUOTE, scan)
            if end < 0 or budget <= 0:
                return
            budget -= 1
            if raw[end - 1] != _BACKSLASH[0]:
                break
            run = raw[scan:end]  # the quote is escaped after an odd run of backslashes
            if (len(run) - len(run.rstrip(_BACKSLASH))) % 2 == 0:
                break
            scan = end + 1
        yield start, end
        pos = end + 1


def _plain_text(raw: bytes, start: int, end: int) -> str | None:
    """raw[start:end] as text when it is printable ASCII (JSON reads it as it is), else
    None; checked `CHECK_PIECE` bytes at a time."""
    for at in range(start, end, CHECK_PIECE):
        if raw[at : min(at + CHECK_PIECE, end)].translate(None, _PRINTABLE):
            return None
    return str(memoryview(raw)[start:end], "ascii")
