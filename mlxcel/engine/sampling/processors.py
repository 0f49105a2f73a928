"""Logits processors: logit bias, repetition / frequency / presence penalties and DRY.

Each factory returns a closure `processor(tokens, logits) -> logits` as mlx-lm's generators
call it: `tokens` is the 1-D context (prompt + generated so far) and `logits` is `[B, V]`
(B is 1 in a decode batch: mlx-lm's batch classes call processors row by row). The
penalties stay lazy MLX graphs; DRY is sequential by nature and runs on the host with numpy
(see `make_dry`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# DRY never follows a repeat further back than this many tokens; the penalty for longer
# matches is the one for this length (with dry_base 1.75 that is already astronomically large).
DRY_MAX_MATCH = 256
# Cap on a single DRY penalty so that base**exponent never overflows.
DRY_MAX_PENALTY = 1e30


def _window(tokens: mx.array, size: int) -> mx.array:
    """The last `size` tokens (-1: all of them)."""
    return tokens if size < 0 else tokens[-size:]


def _row_indices(window: mx.array, logits: mx.array) -> mx.array:
    """`window` as `[B, n]` indices for take/put_along_axis on `logits`."""
    return mx.broadcast_to(window[None, :], (logits.shape[0], window.shape[0]))


def merge_logit_bias(bias: Iterable[tuple[int, float]], vocab_size: int) -> dict[int, float]:
    """`bias` as {token id: value} (later duplicates win); ValueError for an id outside
    the vocabulary."""
    merged: dict[int, float] = {}
    for token, value in bias:
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"logit_bias token id {token} is outside the vocabulary (0..{vocab_size - 1})"
            )
        merged[int(token)] = float(value)
    return merged


def make_logit_bias(bias: Iterable[tuple[int, float]], vocab_size: int) -> LogitsProcessor | None:
    """Add `bias` to the listed token ids (later duplicates win); None when empty."""
    merged = merge_logit_bias(bias, vocab_size)
    if not merged:
        return None
    ids = mx.array(list(merged), dtype=mx.int32)
    values = mx.array(list(merged.values()), dtype=mx.float32)

    def logit_bias(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, ids].add(values.astype(logits.dtype))

    return logit_bias


def make_repetition_penalty(penalty: float, context_size: int) -> LogitsProcessor | None:
    """llama.cpp / HF repetition penalty over the last `context_size` tokens (-1: all).

    A logit of a token present in the window is divided by `penalty` when positive and
    multiplied by it when negative (each distinct token once). None when it is a no-op.
    """
    if penalty == 1.0 or context_size == 0:
        return None

    def repetition_penalty(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        idx = _row_indices(_window(tokens, context_size), logits)
        selected = mx.take_along_axis(logits, idx, axis=-1)
        penalized = mx.where(selected < 0, selected * penalty, selected / penalty)
        return mx.put_along_axis(logits, idx, penalized.astype(logits.dtype), axis=-1)

    return repetition_penalty


def make_frequency_presence_penalty(
    frequency: float, presence: float, context_size: int
) -> LogitsProcessor | None:
    """OpenAI penalties: `logit -= count * frequency + (count > 0) * presence` over the window.

    `count` is the number of times the token occurs in the last `context_size` tokens
    (-1: all). None when both penalties are 0 or the window is empty.
    """
    if (frequency == 0 and presence == 0) or context_size == 0:
        return None

    def frequency_presence_penalty(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size == 0:
            return logits
        window = _window(tokens, context_size)
        if frequency != 0:
            # `.at[...]` accumulates over repeated indices: count * frequency.
            logits = logits.at[:, window].subtract(mx.array(frequency, dtype=logits.dtype))
        if presence != 0:
            # A plain scatter writes the same value for repeated indices: once per token.
            idx = _row_indices(window, logits)
            selected = mx.take_along_axis(logits, idx, axis=-1)
            logits = mx.put_along_axis(
                logits, idx, (selected - presence).astype(logits.dtype), axis=-1
            )
        return logits

    return frequency_presence_penalty


def dry_penalties(
    context: np.ndarray,
    multiplier: float,
    base: float,
    allowed_length: int,
    breakers: np.ndarray | None = None,
    max_match: int = DRY_MAX_MATCH,
) -> tuple[np.ndarray, np.ndarray]:
    """DRY penalties for the next token after `context`: (token ids, penalties).

    For a candidate token `t`, the match length is the longest suffix of `context` that also
    occurs earlier immediately followed by `t` (occurrences may overlap the suffix). When it
    is >= `allowed_length` the penalty is `multiplier * base ** (length - allowed_length)`.
    A match never crosses a sequence breaker (the suffix stops at the last breaker), and
    lengths are capped at `max_match`.

    Cost: one O(n) comparison over the context plus one pass per matched length over the
    surviving candidate positions (usually few); at most `max_match` passes.
    """
    n = int(context.shape[0])
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
    if n < 2 or multiplier <= 0:
        return empty
    limit = min(n - 1, max_match)
    if breakers is not None and breakers.size:
        tail = context[n - limit :]
        hits = np.flatnonzero(np.isin(tail, breakers))
        if hits.size:
            limit = tail.shape[0] - 1 - int(hits[-1])
    if limit < allowed_length:
        return empty
    last = n - 1
    # Candidate positions i (< last) whose token equals the last one: match length >= 1.
    pos = np.flatnonzero(context[:last] == context[last])
    ended_pos: list[np.ndarray] = []
    ended_len: list[np.ndarray] = []
    k = 1
    while pos.size and k < limit:
        # Extend every surviving match by one token to the left (not past the start).
        ok = pos >= k
        ok[ok] = context[pos[ok] - k] == context[last - k]
        if k >= allowed_length and not ok.all():
            stopped = pos[~ok]
            ended_pos.append(stopped)
            ended_len.append(np.full(stopped.shape, k))
        pos = pos[ok]
        k += 1
    if pos.size and k >= allowed_length:
        ended_pos.append(pos)
        ended_len.append(np.full(pos.shape, k))
    if not ended_pos:
        return empty
    # Lengths were recorded in increasing order: the last record of a token is its longest.
    tokens = context[np.concatenate(ended_pos) + 1][::-1]
    lengths = np.concatenate(ended_len)[::-1]
    ids, first = np.unique(tokens, return_index=True)
    best = lengths[first].astype(np.float64)
    with np.errstate(over="ignore"):
        values = multiplier * np.power(base, best - allowed_length)
    values = np.minimum(values, DRY_MAX_PENALTY)
    return ids.astype(np.int64), values.astype(np.float32)


class _HostContext:
    """A host copy of a growing token context, fetching only what is new each step."""

    def __init__(self) -> None:
        self.buffer = np.zeros(0, dtype=np.int64)
        self.size = 0

    def update(self, tokens: mx.array) -> np.ndarray:
        n = int(tokens.size)
        known = self.size
        if 0 < known <= n:
            tail = np.asarray(tokens[known - 1 : n], dtype=np.int64)
            if int(tail[0]) == int(self.buffer[known - 1]):
                self._append(tail[1:])
                return self.buffer[: self.size]
        # First call, or the context is not a continuation of what we saw: start over.
        self.size = 0
        self._append(np.asarray(tokens, dtype=np.int64))
        return self.buffer[: self.size]

    def _append(self, new: np.ndarray) -> None:
        end = self.size + new.shape[0]
        if end > self.buffer.shape[0]:
            grown = np.zeros(max(end, 2 * self.buffer.shape[0], 256), dtype=np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size : end] = new
        self.size = end


def make_dry(
    multiplier: float,
    base: float,
    allowed_length: int,
    penalty_last_n: int,
    sequence_breakers: Sequence[int] = (),
) -> LogitsProcessor | None:
    """DRY ("Don't Repeat Yourself") penalty over the last `penalty_last_n` tokens (<= 0: all).

    Runs on the host: each step copies the newly generated token to numpy (one small host
    sync, which costs some CPU/GPU overlap) and scans the context with `dry_penalties`.
    One processor per request: it caches the context it has seen. None when off.
    """
    if multiplier <= 0 or base < 1:  # llama.cpp turns DRY off below base 1
        return None
    breakers = np.array(sorted(set(sequence_breakers)), dtype=np.int64)
    if base > 1:
        max_exponent = math.floor(math.log(DRY_MAX_PENALTY / multiplier) / math.log(base))
        max_match = max(allowed_length, min(DRY_MAX_MATCH, allowed_length + max_exponent + 1))
    else:
        max_match = allowed_length
    host = _HostContext()

    def dry(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size < 2:
            return logits
        context = host.update(tokens)
        if penalty_last_n > 0:
            context = context[-penalty_last_n:]
        ids, values = dry_penalties(context, multiplier, base, allowed_length, breakers, max_match)
        if ids.size == 0:
            return logits
        return logits.at[:, mx.array(ids, dtype=mx.int32)].subtract(
            mx.array(values).astype(logits.dtype)
        )

    return dry
