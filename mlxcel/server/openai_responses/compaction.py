"""Responses compaction: summarize the older part of a history into one `compaction` item.

Pure logic (no HTTP, no model): the caller injects `count_tokens` (rendered prompt tokens of
a list of items), `to_messages` (items → chat messages) and `summarize` (one non-streamed
generation). Used by POST /v1/responses/compact and by `context_management` on
/v1/responses.

The compaction item and its capsule
    `{"type": "compaction", "id": "cmp_...", "encrypted_content": CAPSULE}`. The capsule is not
    encrypted: it is base64url (written without padding, read with or without) of the JSON
    `{"format": "mlxcel.compaction", "version": 1, "summary": str, "kept": [items],
    "summary_index": int}`: the summary, every item kept beside it (system/developer messages
    first), and where among them the summary is replayed.

Layout
    The compacted history, in replay order, is: the system/developer messages, the summary,
    the last user message when it is older than the kept turns, then the kept turns. The
    compact endpoint's `output` lists the kept items in that order and ends with the
    compaction item; a `context_management` response's output starts with it.

Replay rule (`expand_compactions`, then `compaction_item_messages`)
    The most recent sealed compaction item of a history supersedes every item before it: those
    are dropped and the capsule's kept items are replayed instead, the summary at its place;
    the items after the compaction item are replayed as sent. So a client may send the compact
    output back as it is, append the output of a `context_management` response to its whole
    history, or drop what precedes the compaction item: each replays the same, and no kept
    item is ever replayed twice.

    The summary replays as a user message ("Summary of the earlier conversation: ...") so
    templates that only accept a system message first render it; when a user message comes
    next it is followed by a short assistant acknowledgement, so that templates insisting on
    alternating user/assistant turns render it as well.

Split rules
    System/developer messages are always kept. Of the rest, the newest complete turns that fit
    in `keep_tokens` are kept, plus the last user message. The history is only split before a
    user message, after a finished tool-call group (a `function_call_output`), or after a
    compaction item, never between a `function_call` and its output, never after a pending
    call, and always after the last earlier compaction item (so the output holds exactly one).
"""

from __future__ import annotations

import base64
import binascii
import inspect
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxcel.server.errors import APIError
from mlxcel.server.json_body import decode_json_body

Item = dict[str, Any]
Message = dict[str, Any]
CountTokens = Callable[[list[Item]], int | Awaitable[int]]

CAPSULE_FORMAT = "mlxcel.compaction"
CAPSULE_VERSION = 1
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
DEFAULT_MAX_OUTPUT_TOKENS = 1024
MAX_OUTPUT_TOKENS_LIMIT = 16384
KEEP_TOKENS_CAP = 8192
COMPACT_THRESHOLD_MAX = 100_000_000
EXPANDED_KEY = "_mlxcel_expanded"
"""Marks a compaction item `expand_compactions` already spliced in (internal, never output)."""

SUMMARY_PREFIX = "Summary of the earlier conversation:\n\n"
SUMMARY_ACK = "Understood. I will continue from this summary."
SUMMARY_INSTRUCTION = (
    "You condense conversations. Read the transcript of an earlier part of a conversation "
    "between a user and an assistant and write a summary that lets the assistant continue "
    "the conversation without the transcript. Keep the user's goals, requests, constraints "
    "and preferences; decisions and conclusions; facts, names, numbers, file names, code and "
    "other details that may matter later; the tools called and what they returned; work "
    "that is still open. Leave out small talk and repetition. Write in the language of the "
    "conversation and answer with the summary only."
)

_COMPACT_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "stream",
        "previous_response_id",
        "conversation",
        "keep_tokens",
        "max_output_tokens",
    }
)
_KEPT_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class CompactionError(APIError, ValueError):
    """A compaction that cannot run: 400 by default (`code` "context_length_exceeded" for
    the size rules, None for ordinary request errors). `reason` tells the size rules apart:
    "too_long", "nothing_to_summarize", "summary_does_not_fit", "not_shorter"."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        reason: str | None = None,
        status: int = 400,
    ) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        super().__init__(status, message, kind, code=code, extra={"param": param})
        self.reason = reason


class CompactionAborted(Exception):
    """The summary generation ended without a result (the client went away)."""


class GeneratedSummary(Protocol):
    """What `summarize` may return instead of a plain string (e.g. `GeneratedText`)."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


Summarize = Callable[[list[Message], int], Awaitable[str | GeneratedSummary | None]]


# ---------------------------------------------------------------- capsule and item


@dataclass(frozen=True)
class Capsule:
    """A decoded compaction capsule."""

    summary: str
    kept: list[Item]
    summary_index: int


def _leading_system(items: Sequence[Item]) -> int:
    count = 0
    for item in items:
        if not _is_system(item):
            break
        count += 1
    return count


def encode_capsule(summary: str, kept: list[Item], summary_index: int | None = None) -> str:
    """The base64url capsule (no padding) holding `summary` and the `kept` items; the summary
    is replayed before `kept[summary_index]` (default: after the leading system messages)."""
    index = _leading_system(kept) if summary_index is None else summary_index
    if not 0 <= index <= len(kept):
        raise ValueError(f"summary_index {index} is outside 0..{len(kept)}")
    payload = {
        "format": CAPSULE_FORMAT,
        "version": CAPSULE_VERSION,
        "summary": summary,
        "kept": [_public(item) for item in kept],
        "summary_index": index,
    }
    raw = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def _malformed(detail: str) -> CompactionError:
    return CompactionError(f"invalid compaction item: encrypted_content {detail}", param="input")


def decode_capsule(text: Any) -> Capsule:
    """The capsule in `text` (base64url, padded or not); CompactionError (400) if malformed."""
    if not isinstance(text, str) or not text.strip():
        raise _malformed("must be a non-empty string")
    data = text.strip()
    if len(data) % 4 == 1:
        raise _malformed("is not valid base64url")
    data += "=" * (-len(data) % 4)
    try:
        payload = decode_json_body(base64.b64decode(data, altchars=b"-_", validate=True))
    except (binascii.Error, ValueError, APIError):  # APIError: not JSON, too deep, not text
        raise _malformed("is not a capsule written by this server") from None
    if not isinstance(payload, dict) or payload.get("format") != CAPSULE_FORMAT:
        raise _malformed("is not a capsule written by this server")
    if payload.get("version") != CAPSULE_VERSION:
        raise _malformed(f"has unsupported version {payload.get('version')!r}")
    summary, kept, index = payload.get("summary"), payload.get("kept"), payload.get("summary_index")
    if not isinstance(summary, str):
        raise _malformed("has no summary")
    if not isinstance(kept, list):
        raise _malformed("has no kept item list")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= len(kept):
        raise _malformed("has an invalid summary_index")
    for item in kept:
        if not isinstance(item, dict) or item.get("type") not in _KEPT_TYPES:
            raise _malformed("holds an invalid kept item")
    try:
        from mlxcel.server.openai_responses.items import input_items

        normalized = input_items(kept)
    except APIError as exc:
        raise _malformed(f"holds an invalid kept item ({exc.message})") from None
    return Capsule(summary, normalized, index)


def new_compaction_id() -> str:
    """A fresh compaction item id."""
    return f"cmp_{uuid.uuid4().hex}"


def compaction_item(
    summary: str,
    kept: list[Item],
    *,
    summary_index: int | None = None,
    item_id: str | None = None,
) -> Item:
    """The `compaction` item whose capsule holds `summary` and the `kept` items."""
    return {
        "type": "compaction",
        "id": item_id or new_compaction_id(),
        "encrypted_content": encode_capsule(summary, kept, summary_index),
    }


def _item_capsule(item: Item) -> Capsule:
    if "encrypted_content" not in item:
        raise _malformed("is missing")
    return decode_capsule(item["encrypted_content"])


def compaction_item_messages(item: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a `compaction` item replays as: one user message carrying the
    summary, plus a short assistant acknowledgement when the next kept item is a user
    message (or nothing is kept after it). Only the summary: kept items are replayed where
    `expand_compactions` put them. CompactionError (400) on a malformed capsule."""
    capsule = _item_capsule(item)
    messages: list[Message] = [{"role": "user", "content": SUMMARY_PREFIX + capsule.summary}]
    following = capsule.kept[capsule.summary_index :]
    if not following or _is_message(following[0], "user"):
        messages.append({"role": "assistant", "content": SUMMARY_ACK})
    return messages


def expand_compactions(items: list[Item]) -> list[Item]:
    """`items` with the latest sealed compaction item spliced open: the items before it are
    dropped and its capsule's kept items take their place, the compaction item (marked as
    expanded) at the summary's position, followed by the items after it. Idempotent; the
    input is not changed. CompactionError (400) on a malformed capsule."""
    last = None
    for index, item in enumerate(items):
        if item.get("type") == "compaction" and not item.get(EXPANDED_KEY):
            last = index
    if last is None:
        return list(items)
    capsule = _item_capsule(items[last])
    at = capsule.summary_index
    marked = {**items[last], EXPANDED_KEY: True}
    return [*capsule.kept[:at], marked, *capsule.kept[at:], *items[last + 1 :]]


def _public(item: Item) -> Item:
    return {k: v for k, v in item.items() if k != EXPANDED_KEY}


# ---------------------------------------------------------------- split plan


def _is_message(item: Item, *roles: str) -> bool:
    return item.get("type") == "message" and item.get("role") in roles


def _is_system(item: Item) -> bool:
    return _is_message(item, "system", "developer")


@dataclass(frozen=True)
class CompactionPlan:
    """How a history splits: `system_items` (always kept), `to_summarize` (older items, in
    order) and `kept_items` (the last user message when it is older than the split, then the
    kept turns, in order). Replay layout: system_items, summary, kept_items."""

    system_items: list[Item]
    to_summarize: list[Item]
    kept_items: list[Item]

    @property
    def kept(self) -> list[Item]:
        """Every kept item in output order (system/developer messages first)."""
        return [*self.system_items, *self.kept_items]


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def split_points(seq: Sequence[Item]) -> list[int]:
    """The indices `i` at which `seq` (system messages already removed) may be split into an
    older part `seq[:i]` and a kept part `seq[i:]`, ascending (see the module docstring)."""
    n = len(seq)
    spans: dict[str, list[int]] = {}
    answered: set[str] = set()
    last_message = -1
    last_compaction = -1
    for index, item in enumerate(seq):
        kind = item.get("type")
        if kind == "message":
            last_message = index
        elif kind == "compaction":
            last_compaction = index
        elif kind in ("function_call", "function_call_output"):
            call_id = item.get("call_id")
            if isinstance(call_id, str):
                span = spans.setdefault(call_id, [index, index])
                span[1] = index
                if kind == "function_call_output":
                    answered.add(call_id)
    blocked = [False] * (n + 2)
    for call_id, (first, last) in spans.items():
        for i in range(first + 1, last + 1):  # a call and its output stay together
            blocked[i] = True
        if call_id not in answered and first > last_message:  # a pending call: keep it
            for i in range(first + 1, n + 1):
                blocked[i] = True
    points: list[int] = []
    for i in range(last_compaction + 1, n + 1):
        if blocked[i]:
            continue
        if (
            i in (0, n)
            or _is_message(seq[i], "user")
            or seq[i - 1].get("type") in ("function_call_output", "compaction")
        ):
            points.append(i)
    return points


async def plan_compaction(
    items: list[Item], *, count_tokens: CountTokens, keep_tokens: int
) -> CompactionPlan:
    """Split `items` (compactions already expanded): the largest kept part, starting at a
    split point, whose tokens (`count_tokens` of the kept items) fit in `keep_tokens`; the
    last user message is always kept. `count_tokens` may be sync or async."""
    system = [item for item in items if _is_system(item)]
    seq = [item for item in items if not _is_system(item)]
    users = [index for index, item in enumerate(seq) if _is_message(item, "user")]
    last_user = users[-1] if users else None
    points = split_points(seq)
    if not points:
        return CompactionPlan(system, [], seq)

    def kept_at(i: int) -> list[Item]:
        pinned = [seq[last_user]] if last_user is not None and last_user < i else []
        return [*pinned, *seq[i:]]

    costs: dict[int, int] = {}

    async def cost(i: int) -> int:
        if i not in costs:
            kept = kept_at(i)
            costs[i] = int(await _value(count_tokens(kept))) if kept else 0
        return costs[i]

    lo, hi = 0, len(points) - 1  # the first point whose kept part fits (or the last one)
    while lo < hi:
        mid = (lo + hi) // 2
        if await cost(points[mid]) <= keep_tokens:
            hi = mid
        else:
            lo = mid + 1
    split = points[lo]
    older = [item for index, item in enumerate(seq[:split]) if index != last_user]
    return CompactionPlan(system, older, kept_at(split))


# ---------------------------------------------------------------- summarization prompt


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") in ("image_url", "input_image"):
                parts.append("[image]")
            elif isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
        return "\n".join(parts)
    return "" if content is None else str(content)


def render_transcript(messages: Sequence[Message]) -> str:
    """A plain-text transcript of chat `messages` (reasoning left out, images as [image])."""
    blocks: list[str] = []
    for message in messages:
        role = str(message.get("role", "user"))
        text = _text(message.get("content")).strip()
        if role == "tool":
            name = message.get("name") or message.get("tool_call_id") or "tool"
            blocks.append(f"Tool result ({name}):\n{text}")
            continue
        if role == "user" and text.startswith(SUMMARY_PREFIX.strip()):
            blocks.append(f"Earlier summary:\n{text[len(SUMMARY_PREFIX.strip()) :].strip()}")
            continue
        if role == "assistant" and text == SUMMARY_ACK and not message.get("tool_calls"):
            continue
        if text:
            blocks.append(f"{role.capitalize()}:\n{text}")
        for call in message.get("tool_calls") or []:
            function = (call.get("function") or {}) if isinstance(call, dict) else {}
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            blocks.append(f"Assistant called {function.get('name', '?')}({arguments})")
    return "\n\n".join(blocks)


def summary_messages(
    messages: Sequence[Message], *, instruction: str = SUMMARY_INSTRUCTION
) -> list[Message]:
    """The summarization prompt for the older chat `messages`: a system instruction and one
    user message holding their transcript (any chat template renders this)."""
    transcript = render_transcript(messages)
    return [
        {"role": "system", "content": instruction},
        {
            "role": "user",
            "content": (
                "Transcript of the earlier conversation:\n\n"
                f"<transcript>\n{transcript}\n</transcript>\n\nWrite the summary now."
            ),
        },
    ]


# ---------------------------------------------------------------- compaction


def default_keep_tokens(context_window: int) -> int:
    """Default `keep_tokens`: 1/16 of the context window, at most 8192 (at least 1)."""
    return max(1, min(KEEP_TOKENS_CAP, context_window // 16))


@dataclass
class CompactionResult:
    """A finished compaction."""

    item: Item  # the compaction item (sealed)
    plan: CompactionPlan
    summary: str
    input_tokens_before: int
    input_tokens_after: int
    summary_prompt_tokens: int
    summary_output_tokens: int
    truncated: bool = False  # the summary stopped at its token limit
    history: list[Item] = field(default_factory=list)  # replay order, compaction expanded

    @property
    def output(self) -> list[Item]:
        """The compact endpoint's `output`: kept items (system first), then the item."""
        return [*self.plan.kept, self.item]

    def usage(self) -> dict[str, Any]:
        """Usage of the summary generation, in the Responses shape."""
        return {
            "input_tokens": self.summary_prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": self.summary_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.summary_prompt_tokens + self.summary_output_tokens,
        }


def _too_big(message: str, reason: str) -> CompactionError:
    return CompactionError(message, code=CONTEXT_LENGTH_EXCEEDED, param="input", reason=reason)


def _check_limits(keep_tokens: int | None, max_output_tokens: int) -> None:
    if keep_tokens is not None and (
        isinstance(keep_tokens, bool) or not isinstance(keep_tokens, int) or keep_tokens <= 0
    ):
        raise CompactionError("keep_tokens must be an integer greater than 0", param="keep_tokens")
    if (
        isinstance(max_output_tokens, bool)
        or not isinstance(max_output_tokens, int)
        or not 1 <= max_output_tokens <= MAX_OUTPUT_TOKENS_LIMIT
    ):
        raise CompactionError(
            f"max_output_tokens must be an integer from 1 to {MAX_OUTPUT_TOKENS_LIMIT}",
            param="max_output_tokens",
        )


async def compact(
    items: list[Item],
    *,
    count_tokens: CountTokens,
    summarize: Summarize,
    to_messages: Callable[[list[Item]], list[Message]],
    context_window: int,
    keep_tokens: int | None = None,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    input_tokens: int | None = None,
    on_start: Callable[[int], Any] | None = None,
) -> CompactionResult:
    """Compact `items` (normalized; compaction items allowed): plan the split, summarize the
    older part in one generation of at most `max_output_tokens` (less when the context has
    less room), and check the result.

    `input_tokens` is `count_tokens(items)` when the caller already has it; `on_start(tokens
    before)` (sync or async) runs right before the summary generation. Raises
    CompactionError with code "context_length_exceeded" when the history is longer than
    `context_window`, nothing can be summarized, the summarization prompt leaves no room for
    a summary, or the result is not shorter than the input; `items` is never changed.
    """
    _check_limits(keep_tokens, max_output_tokens)
    keep = default_keep_tokens(context_window) if keep_tokens is None else keep_tokens
    expanded = expand_compactions(items)
    before = int(await _value(count_tokens(expanded))) if input_tokens is None else input_tokens
    if before > context_window:
        raise _too_big(
            f"the input ({before} tokens) is longer than the context window "
            f"({context_window} tokens)",
            "too_long",
        )
    plan = await plan_compaction(expanded, count_tokens=count_tokens, keep_tokens=keep)
    if not plan.to_summarize:
        raise _too_big(
            f"nothing to compact: the history fits in keep_tokens ({keep})",
            "nothing_to_summarize",
        )
    prompt = summary_messages(to_messages(plan.to_summarize))
    prompt_tokens = int(
        await _value(count_tokens([{"type": "message", **message} for message in prompt]))
    )
    room = context_window - prompt_tokens
    if room < 1:
        raise _too_big(
            f"the summary does not fit: summarizing takes {prompt_tokens} prompt tokens of a "
            f"{context_window}-token context window",
            "summary_does_not_fit",
        )
    if on_start is not None:
        await _value(on_start(before))
    budget = min(max_output_tokens, room)
    generated = await summarize(prompt, budget)
    if generated is None:
        raise CompactionAborted("the summary generation ended without a result")
    if isinstance(generated, str):
        text, truncated = generated, False
        used_prompt, used_output = prompt_tokens, None
    else:
        text, truncated = generated.text, generated.finish_reason == "length"
        used_prompt, used_output = generated.prompt_tokens, generated.completion_tokens
    summary = (text or "").strip()
    if not summary:
        if truncated:
            raise _too_big(
                f"the summary does not fit in {budget} output tokens", "summary_does_not_fit"
            )
        raise CompactionError("the model produced an empty summary", status=500)
    item = compaction_item(summary, plan.kept, summary_index=len(plan.system_items))
    history = [*plan.system_items, {**item, EXPANDED_KEY: True}, *plan.kept_items]
    after = int(await _value(count_tokens(history)))
    if after >= before:
        raise _too_big(
            f"compaction would not shorten the input ({before} tokens before, {after} after)",
            "not_shorter",
        )
    if used_output is None:
        used_output = await _summary_tokens(summary, count_tokens)
    return CompactionResult(
        item=item,
        plan=plan,
        summary=summary,
        input_tokens_before=before,
        input_tokens_after=after,
        summary_prompt_tokens=used_prompt,
        summary_output_tokens=used_output,
        truncated=truncated,
        history=history,
    )


async def _summary_tokens(summary: str, count_tokens: CountTokens) -> int:
    """Tokens of `summary` as an assistant message, less those of an empty one."""
    full = await _value(
        count_tokens([{"type": "message", "role": "assistant", "content": summary}])
    )
    empty = await _value(count_tokens([{"type": "message", "role": "assistant", "content": ""}]))
    return max(0, int(full) - int(empty))


def compact_response(
    result: CompactionResult,
    *,
    model: str,
    created_at: int | None = None,
    response_id: str | None = None,
) -> dict[str, Any]:
    """The body of POST /v1/responses/compact for `result`."""
    return {
        "id": response_id or f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()) if created_at is None else created_at,
        "model": model,
        "output": [_public(item) for item in result.output],
        "usage": result.usage(),
    }


# ---------------------------------------------------------------- context_management


def needs_compaction(input_tokens: int, *, threshold: int, context_window: int) -> bool:
    """Whether a `context_management` request compacts first: the input reaches `threshold`
    or leaves no room for output in the context window."""
    return input_tokens >= threshold or input_tokens >= context_window


def output_budget(context_window: int, input_tokens: int, max_output_tokens: int | None) -> int:
    """Tokens a `context_management` request may generate: the room left in the context,
    capped by `max_output_tokens` (0 when there is no room)."""
    room = max(0, context_window - input_tokens)
    return room if max_output_tokens is None else min(room, max_output_tokens)


def auto_keep_tokens(context_window: int, threshold: int) -> int:
    """`keep_tokens` for automatic compaction: the default, but at most half the threshold,
    so the compacted history falls below the threshold instead of compacting every turn."""
    return max(1, min(default_keep_tokens(context_window), threshold // 2))


async def auto_compact(
    items: list[Item],
    *,
    threshold: int,
    count_tokens: CountTokens,
    summarize: Summarize,
    to_messages: Callable[[list[Item]], list[Message]],
    context_window: int,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    input_tokens: int | None = None,
    on_start: Callable[[int], Any] | None = None,
) -> CompactionResult | None:
    """Compaction for `context_management`: None when the input stays below `threshold` and
    leaves room for output, or when it cannot be compacted (nothing old enough to summarize,
    no room to summarize) but still leaves room for output; otherwise `compact`'s result or
    its CompactionError. `on_start` runs only when a summary is generated."""
    expanded = expand_compactions(items)
    before = int(await _value(count_tokens(expanded))) if input_tokens is None else input_tokens
    if not needs_compaction(before, threshold=threshold, context_window=context_window):
        return None
    try:
        return await compact(
            expanded,
            count_tokens=count_tokens,
            summarize=summarize,
            to_messages=to_messages,
            context_window=context_window,
            keep_tokens=auto_keep_tokens(context_window, threshold),
            max_output_tokens=max_output_tokens,
            input_tokens=before,
            on_start=on_start,
        )
    except CompactionError as exc:
        skippable = exc.reason in ("nothing_to_summarize", "summary_does_not_fit")
        if skippable and before < context_window:
            return None
        raise


# ---------------------------------------------------------------- request fields


@dataclass(frozen=True)
class CompactRequest:
    """A checked POST /v1/responses/compact body."""

    model: str | None
    input: str | list[Any]
    instructions: str | None = None
    keep_tokens: int | None = None
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    extra: dict[str, Any] = field(default_factory=dict)  # other fields (sampling...)

    @property
    def items(self) -> list[Item]:
        """`input` as normalized items (400 on items this server cannot replay)."""
        from mlxcel.server.openai_responses.items import input_items

        return input_items(self.input)


def _int_field(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise CompactionError(f"{key} must be an integer", param=key)
    return value


def parse_compact_request(body: Any) -> CompactRequest:
    """Check a POST /v1/responses/compact body; CompactionError (400, code None) on
    `stream: true`, `previous_response_id`, `conversation`, a missing or empty `input`,
    `keep_tokens` <= 0 or `max_output_tokens` outside 1..16384."""
    if not isinstance(body, dict):
        raise CompactionError("the request body must be a JSON object")
    if body.get("stream") not in (None, False):
        raise CompactionError("stream is not supported by /v1/responses/compact", param="stream")
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise CompactionError(
                f"{key} is not supported by /v1/responses/compact: send the whole history in input",
                param=key,
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise CompactionError("model must be a string", param="model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise CompactionError("instructions must be a string", param="instructions")
    value = body.get("input")
    if value is None:
        raise CompactionError("input is required", param="input")
    if not isinstance(value, (str, list)):
        raise CompactionError("input must be a string or a list of items", param="input")
    if not value:
        raise CompactionError("input must not be empty", param="input")
    keep = _int_field(body, "keep_tokens")
    if keep is not None and keep <= 0:
        raise CompactionError("keep_tokens must be greater than 0", param="keep_tokens")
    max_output = _int_field(body, "max_output_tokens")
    if max_output is not None and not 1 <= max_output <= MAX_OUTPUT_TOKENS_LIMIT:
        raise CompactionError(
            f"max_output_tokens must be from 1 to {MAX_OUTPUT_TOKENS_LIMIT}",
            param="max_output_tokens",
        )
    return CompactRequest(
        model=model,
        input=value,
        instructions=instructions,
        keep_tokens=keep,
        max_output_tokens=DEFAULT_MAX_OUTPUT_TOKENS if max_output is None else max_output,
        extra={k: v for k, v in body.items() if k not in _COMPACT_FIELDS},
    )


def parse_context_management(value: Any) -> int | None:
    """The compaction threshold of a /v1/responses `context_management` value: None when
    absent or empty; a `compaction` entry without `compact_threshold` means "only when the
    context is full" (100000000). CompactionError (400) on other entry types, a second
    compaction entry, or a threshold outside 1..100000000."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise CompactionError(
            "context_management must be a list of entries", param="context_management"
        )
    threshold: int | None = None
    for index, entry in enumerate(value):
        where = f"context_management[{index}]"
        if not isinstance(entry, dict):
            raise CompactionError(f"{where} must be an object", param=where)
        if entry.get("type") != "compaction":
            raise CompactionError(
                f"{where}.type must be 'compaction' (got {entry.get('type')!r})",
                param=f"{where}.type",
            )
        if threshold is not None:
            raise CompactionError(
                f"{where}: only one compaction entry is allowed", param=f"{where}.type"
            )
        raw = entry.get("compact_threshold")
        if raw is None:
            threshold = COMPACT_THRESHOLD_MAX
            continue
        if (
            isinstance(raw, bool)
            or not isinstance(raw, int)
            or not 1 <= raw <= COMPACT_THRESHOLD_MAX
        ):
            raise CompactionError(
                f"{where}.compact_threshold must be an integer from 1 to {COMPACT_THRESHOLD_MAX}",
                param=f"{where}.compact_threshold",
            )
        threshold = raw
    return threshold
