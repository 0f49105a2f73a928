"""Responses compaction logic (mlxcel/server/openai_responses/compaction.py), without a model.

`count_tokens` is a stand-in counting words (plus one per chat message) of the chat messages
a small stand-in converter makes; `summarize` is a scripted coroutine.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.server.errors import APIError
from mlxcel.server.openai_responses.compaction import (
    COMPACT_THRESHOLD_MAX,
    CONTEXT_LENGTH_EXCEEDED,
    EXPANDED_KEY,
    SUMMARY_ACK,
    SUMMARY_INSTRUCTION,
    SUMMARY_PREFIX,
    CompactionError,
    CompactionPlan,
    auto_compact,
    compact,
    compact_response,
    compaction_item,
    compaction_item_messages,
    decode_capsule,
    default_keep_tokens,
    encode_capsule,
    expand_compactions,
    needs_compaction,
    output_budget,
    parse_compact_request,
    parse_context_management,
    plan_compaction,
    split_points,
    summary_messages,
)

Item = dict[str, Any]

# ---------------------------------------------------------------- stand-ins and builders


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if isinstance(p, dict))


def to_messages(items: list[Item]) -> list[dict[str, Any]]:
    """A small items → chat messages converter (reasoning dropped)."""
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind == "compaction":
            out.extend(compaction_item_messages(item))
    return out


def words(items: list[Item]) -> int:
    """Deterministic token count: words of every chat message, plus one per message."""
    total = 0
    for message in to_messages(items):
        total += 1 + len(_text(message["content"]).split())
        for call in message.get("tool_calls", []):
            total += 1 + len(call["function"]["arguments"].split())
    return total


async def async_words(items: list[Item]) -> int:
    return words(items)


class Summarizer:
    """A scripted `summarize`: records its prompts and budgets, answers `reply`."""

    def __init__(self, reply: Any = "short summary") -> None:
        self.reply = reply
        self.calls: list[tuple[list[dict[str, Any]], int]] = []

    async def __call__(self, messages: list[dict[str, Any]], max_tokens: int) -> Any:
        self.calls.append((messages, max_tokens))
        return self.reply


class Generated:
    """Shaped like serving.GeneratedText."""

    def __init__(self, text: str, finish_reason: str = "stop") -> None:
        self.text = text
        self.reasoning = None
        self.prompt_tokens = 321
        self.completion_tokens = 12
        self.finish_reason = finish_reason


def msg(role: str, text: str, ident: str) -> Item:
    return {"type": "message", "role": role, "content": text, "id": ident}


def user(text: str, ident: str) -> Item:
    return msg("user", text, ident)


def assistant(text: str, ident: str) -> Item:
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
        "id": ident,
    }


def call(call_id: str, args: str = "{}") -> Item:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": "lookup",
        "arguments": args,
        "id": f"fc_{call_id}",
    }


def output(call_id: str, text: str = "result") -> Item:
    return {
        "type": "function_call_output",
        "call_id": call_id,
        "output": text,
        "id": f"out_{call_id}",
    }


def ids(items: list[Item]) -> list[Any]:
    return [
        "compaction" if item["type"] == "compaction" else item.get("id", item["type"])
        for item in items
    ]


def filler(n: int) -> str:
    return " ".join(["word"] * n)


def history() -> list[Item]:
    """system, three user turns (the second with a tool call), ten words per message."""
    return [
        msg("system", "You are helpful.", "sys"),
        user(filler(10), "u1"),
        assistant(filler(10), "a1"),
        user(filler(10), "u2"),
        call("c1", "x"),
        output("c1", filler(10)),
        assistant(filler(10), "a2"),
        user(filler(10), "u3"),
        assistant(filler(10), "a3"),
    ]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def do_compact(items: list[Item], summarizer: Summarizer | None = None, **kw: Any) -> Any:
    options: dict[str, Any] = {
        "count_tokens": words,
        "summarize": summarizer or Summarizer(),
        "to_messages": to_messages,
        "context_window": 4096,
        "keep_tokens": 30,
    }
    options.update(kw)
    return run(compact(items, **options))


# ---------------------------------------------------------------- capsule


def test_capsule_round_trip_with_and_without_padding() -> None:
    kept = [msg("system", "sys", "s"), user("héllo → 世界", "u")]
    text = encode_capsule("the summary ✓", kept)
    assert "=" not in text and "+" not in text and "/" not in text
    for candidate in (text, text + "=" * (-len(text) % 4), f"  {text}\n"):
        capsule = decode_capsule(candidate)
        assert capsule.summary == "the summary ✓"
        assert ids(capsule.kept) == ["s", "u"]
        assert capsule.kept[1]["content"] == "héllo → 世界"
        assert capsule.summary_index == 1  # after the leading system message
    payload = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    assert payload["format"] == "mlxcel.compaction" and payload["version"] == 1


def test_capsule_keeps_an_explicit_summary_index() -> None:
    kept = [user("a", "u1"), user("b", "u2")]
    assert decode_capsule(encode_capsule("s", kept, summary_index=2)).summary_index == 2
    with pytest.raises(ValueError):
        encode_capsule("s", kept, summary_index=3)


def _b64(payload: Any) -> str:
    raw = json.dumps(payload).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


GOOD = {"format": "mlxcel.compaction", "version": 1, "summary": "s", "kept": [], "summary_index": 0}


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        None,
        42,
        "abcde",  # length 1 mod 4: never base64
        "@@@@",  # outside the alphabet
        base64.urlsafe_b64encode(b"not json").decode(),
        _b64(["a list"]),
        _b64({**GOOD, "format": "someone.else"}),
        _b64({**GOOD, "version": 2}),
        _b64({**GOOD, "summary": 5}),
        _b64({**GOOD, "kept": {}}),
        _b64({**GOOD, "summary_index": 1}),
        _b64({**GOOD, "summary_index": True}),
        _b64({**GOOD, "kept": [{"type": "compaction"}]}),
        _b64({**GOOD, "kept": ["text"]}),
        _b64({**GOOD, "kept": [{"type": "message", "role": "robot", "content": "x"}]}),
        _b64({**GOOD, "kept": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
    ],
)
def test_malformed_capsules_are_400(text: Any) -> None:
    with pytest.raises(CompactionError) as info:
        decode_capsule(text)
    error = info.value
    assert isinstance(error, APIError) and isinstance(error, ValueError)
    assert error.status == 400 and error.type == "invalid_request_error"
    assert error.code is None
    with pytest.raises(CompactionError):
        compaction_item_messages({"type": "compaction", "encrypted_content": text})


def test_compaction_item_without_content_is_400() -> None:
    with pytest.raises(CompactionError, match="missing"):
        compaction_item_messages({"type": "compaction", "id": "cmp_1"})
    with pytest.raises(CompactionError):
        expand_compactions([user("x", "u"), {"type": "compaction"}])


def test_compaction_item_shape() -> None:
    item = compaction_item("sum", [user("q", "u")], item_id="cmp_x")
    assert set(item) == {"type", "id", "encrypted_content"}
    assert item["type"] == "compaction" and item["id"] == "cmp_x"
    assert compaction_item("sum", [])["id"].startswith("cmp_")
    assert decode_capsule(item["encrypted_content"]).summary == "sum"


# ---------------------------------------------------------------- replay


def test_replay_messages_alternate_roles() -> None:
    before_user = compaction_item("S", [msg("system", "x", "s"), user("q", "u")])
    assert compaction_item_messages(before_user) == [
        {"role": "user", "content": SUMMARY_PREFIX + "S"},
        {"role": "assistant", "content": SUMMARY_ACK},
    ]
    before_assistant = compaction_item("S", [call("c"), output("c"), assistant("a", "a")])
    assert compaction_item_messages(before_assistant) == [
        {"role": "user", "content": SUMMARY_PREFIX + "S"}
    ]
    nothing_after = compaction_item("S", [msg("developer", "x", "d")])
    assert [m["role"] for m in compaction_item_messages(nothing_after)] == ["user", "assistant"]
    # the messages are plain chat messages with string content
    for message in compaction_item_messages(before_user):
        assert set(message) == {"role", "content"} and isinstance(message["content"], str)


def test_expand_splices_the_latest_compaction_and_drops_what_precedes_it() -> None:
    kept = [msg("system", "sys", "s"), user("task", "u")]
    item = compaction_item("S", kept)
    new = [assistant("answer", "a"), user("next", "u2")]
    older = [user("old", "o1"), assistant("old", "o2")]
    # the compact output sent back, the full history with the output appended, and a history
    # pruned before the compaction item all replay the same
    as_output = [*kept, item, *new]
    appended = [*older, *kept, compaction_item("older", []), item, *new]
    pruned = [item, *new]
    snapshot = copy.deepcopy(appended)
    results = [expand_compactions(x) for x in (as_output, appended, pruned)]
    assert appended == snapshot  # not changed in place
    for result in results:
        assert ids(result) == ["s", "compaction", "u", "a", "u2"]
        assert result[1][EXPANDED_KEY] is True
        assert result[1]["id"] == item["id"]
    assert to_messages(results[0]) == to_messages(results[1]) == to_messages(results[2])
    # no kept item replayed twice, and expanding again changes nothing
    assert expand_compactions(results[0]) == results[0]
    assert expand_compactions(new) == new and expand_compactions(new) is not new


def test_replay_through_the_responses_item_converter() -> None:
    from mlxcel.server.openai_responses.items import input_items, items_to_messages

    kept = [user("What is 2+2?", "u")]
    item = compaction_item("The user likes arithmetic.", kept)
    items = expand_compactions(input_items([item, {"role": "user", "content": "and 3+3?"}]))
    messages = items_to_messages(items)
    assert messages == [
        {"role": "user", "content": SUMMARY_PREFIX + "The user likes arithmetic."},
        {"role": "assistant", "content": SUMMARY_ACK},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "user", "content": "and 3+3?"},
    ]


# ---------------------------------------------------------------- split rules


def test_split_points() -> None:
    seq = [
        user("q", "u1"),
        assistant("a", "a1"),
        user("q", "u2"),
        call("c1"),
        call("c2"),
        output("c1"),
        output("c2"),
        assistant("a", "a2"),
        user("q", "u3"),
        call("c3"),
    ]
    # before users (0, 2, 8), after the finished group (7); never inside c1/c2 (4..6), never
    # after the pending c3 (10)
    assert split_points(seq) == [0, 2, 7, 8]
    with_compaction = [user("q", "u1"), {"type": "compaction"}, assistant("a", "a1")]
    assert split_points(with_compaction) == [2, 3]
    # an old call never answered does not pin anything once a message follows it
    assert split_points([user("q", "u"), call("z"), assistant("a", "a")]) == [0, 3]


def test_function_call_stays_with_its_output() -> None:
    items = [
        user(filler(5), "u1"),
        call("c1", filler(20)),
        output("c1", filler(20)),
        assistant(filler(3), "a1"),
    ]
    # the kept budget would fit the output and the answer, but not the call as well
    plan = run(plan_compaction(items, count_tokens=words, keep_tokens=30))
    assert ids(plan.to_summarize) == ["fc_c1", "out_c1"]
    assert ids(plan.kept_items) == ["u1", "a1"]


def test_last_user_message_is_always_kept() -> None:
    items = [user(filler(50), "u1"), call("c1"), output("c1"), assistant("done", "a1")]
    plan = run(plan_compaction(items, count_tokens=words, keep_tokens=5))
    assert ids(plan.kept_items) == ["u1"]  # pinned although over budget
    assert ids(plan.to_summarize) == ["fc_c1", "out_c1", "a1"]
    plan = run(plan_compaction(items, count_tokens=words, keep_tokens=words([items[0]]) + 2))
    assert ids(plan.kept_items) == ["u1", "a1"]
    assert ids(plan.to_summarize) == ["fc_c1", "out_c1"]


def test_keep_tokens_budget_is_respected() -> None:
    items = history()
    assert split_points(items[1:]) == [0, 2, 5, 6, 8]
    # kept parts by split point: u3 (11 tokens), u3 a3 (22), a2 u3 a3 (33), u2.. (58), all (80)
    expected = {
        1: ["u3"],  # over budget, but the last user message is always kept
        21: ["u3"],
        22: ["u3", "a3"],
        32: ["u3", "a3"],
        33: ["a2", "u3", "a3"],
        57: ["a2", "u3", "a3"],
        58: ["u2", "fc_c1", "out_c1", "a2", "u3", "a3"],
        80: ["u1", "a1", "u2", "fc_c1", "out_c1", "a2", "u3", "a3"],
    }
    for keep, kept in expected.items():
        plan = run(plan_compaction(items, count_tokens=async_words, keep_tokens=keep))
        assert ids(plan.kept_items) == kept, keep
        assert words(plan.kept_items) <= keep or keep < 11
        assert ids(plan.system_items) == ["sys"]


def test_system_and_developer_messages_are_kept_in_order() -> None:
    items = [
        msg("system", "first", "s1"),
        user(filler(30), "u1"),
        msg("developer", "second", "d1"),
        assistant(filler(30), "a1"),
        user("q", "u2"),
        msg("system", "third", "s2"),
        assistant("a", "a2"),
    ]
    plan = run(plan_compaction(items, count_tokens=words, keep_tokens=8))
    assert ids(plan.system_items) == ["s1", "d1", "s2"]
    assert ids(plan.to_summarize) == ["u1", "a1"]
    assert ids(plan.kept_items) == ["u2", "a2"]
    assert ids(plan.kept) == ["s1", "d1", "s2", "u2", "a2"]


# ---------------------------------------------------------------- compact


def test_compact_output_summary_and_usage() -> None:
    items = history()
    snapshot = copy.deepcopy(items)
    summarizer = Summarizer("the user asked twice")
    result = do_compact(items, summarizer, max_output_tokens=50)
    assert items == snapshot
    assert ids(result.output) == ["sys", "u3", "a3", "compaction"]
    capsule = decode_capsule(result.item["encrypted_content"])
    assert capsule.summary == "the user asked twice" == result.summary
    assert ids(capsule.kept) == ["sys", "u3", "a3"] and capsule.summary_index == 1
    assert ids(result.history) == ["sys", "compaction", "u3", "a3"]
    assert result.input_tokens_before == words(items)
    assert result.input_tokens_after == words(result.history) < result.input_tokens_before
    # one generation: the system instruction and the transcript of the older turns only
    [(prompt, budget)] = summarizer.calls
    assert budget == 50
    assert prompt[0] == {"role": "system", "content": SUMMARY_INSTRUCTION}
    assert [m["role"] for m in prompt] == ["system", "user"]
    transcript = prompt[1]["content"]
    assert "Assistant called lookup(x)" in transcript and "Tool result (c1)" in transcript
    assert transcript.count(filler(10)) == 5  # u1 a1 u2 c1-output a2, not u3 a3
    assert "You are helpful." not in transcript
    usage = result.usage()
    assert usage["input_tokens"] == words([{"type": "message", **m} for m in prompt])
    assert usage["output_tokens"] == 4  # words of the summary
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    body = compact_response(result, model="m", created_at=7, response_id="resp_1")
    assert body["object"] == "response.compaction" and body["model"] == "m"
    assert body["id"] == "resp_1" and body["created_at"] == 7
    assert body["output"][-1] == result.item and body["usage"] == usage
    assert all(EXPANDED_KEY not in item for item in body["output"])


def test_compact_budget_is_capped_by_the_room_left() -> None:
    summarizer = Summarizer()
    result = do_compact(history(), summarizer, context_window=200, max_output_tokens=1000)
    prompt, budget = summarizer.calls[0]
    room = 200 - words([{"type": "message", **m} for m in prompt])
    assert budget == room < 1000
    assert result.summary == "short summary"


def test_compact_reports_generated_usage_and_truncation() -> None:
    result = do_compact(history(), Summarizer(Generated("cut short", "length")))
    assert result.truncated is True
    assert result.usage()["input_tokens"] == 321 and result.usage()["output_tokens"] == 12


def test_second_compaction_over_a_compacted_history() -> None:
    first = do_compact(history(), Summarizer("FIRST SUMMARY"))
    follow_up = [
        *first.output,
        assistant(filler(10), "a4"),
        user(filler(10), "u5"),
        assistant(filler(10), "a5"),
    ]
    # a history that starts with the compaction item (the client pruned what preceded it)
    pruned = follow_up[follow_up.index(first.item) :]
    for items in (follow_up, pruned):
        summarizer = Summarizer("SECOND")
        second = do_compact(items, summarizer, keep_tokens=25)
        compactions = [item for item in second.output if item["type"] == "compaction"]
        assert compactions == [second.output[-1]]
        assert ids(second.output) == ["sys", "u5", "a5", "compaction"]
        transcript = summarizer.calls[0][0][1]["content"]
        assert "Earlier summary:\nFIRST SUMMARY" in transcript
        assert SUMMARY_ACK not in transcript
        assert filler(10) in transcript  # u3, a3, a4 are summarized now
        assert decode_capsule(second.item["encrypted_content"]).summary == "SECOND"


def test_compact_keeps_the_last_user_message_before_the_summary() -> None:
    items = [
        user("please fix the bug", "task"),
        call("c1", filler(10)),
        output("c1", filler(10)),
        call("c2", filler(10)),
        output("c2", filler(10)),
        assistant("done", "a"),
    ]
    result = do_compact(items, keep_tokens=words([items[0], items[-1]]))
    assert ids(result.history) == ["compaction", "task", "a"]
    assert ids(result.plan.to_summarize) == ["fc_c1", "out_c1", "fc_c2", "out_c2"]
    assert ids(result.output) == ["task", "a", "compaction"]
    # the replay: summary, acknowledgement, the task, the answer
    assert [m["role"] for m in to_messages(result.history)] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]


def _expect_too_big(reason: str, items: list[Item], **kw: Any) -> Summarizer:
    summarizer = kw.pop("summarizer", Summarizer())
    snapshot = copy.deepcopy(items)
    with pytest.raises(CompactionError) as info:
        do_compact(items, summarizer, **kw)
    assert info.value.status == 400 and info.value.code == CONTEXT_LENGTH_EXCEEDED
    assert info.value.reason == reason
    assert items == snapshot
    return summarizer


def test_history_longer_than_the_context_window() -> None:
    summarizer = _expect_too_big("too_long", history(), context_window=words(history()) - 1)
    assert summarizer.calls == []
    do_compact(history(), context_window=words(history()) + 150)  # fits: no error


def test_summary_that_does_not_fit() -> None:
    items = history()
    prompt_tokens = len(SUMMARY_INSTRUCTION.split()) + 20
    assert words(items) < prompt_tokens  # the history itself fits the window
    summarizer = _expect_too_big("summary_does_not_fit", items, context_window=prompt_tokens)
    assert summarizer.calls == []
    empty = Summarizer(Generated("", "length"))
    _expect_too_big("summary_does_not_fit", items, summarizer=empty)
    assert len(empty.calls) == 1


def test_result_not_shorter_than_the_input() -> None:
    _expect_too_big("not_shorter", history(), summarizer=Summarizer(filler(60)))


def test_nothing_to_summarize() -> None:
    summarizer = _expect_too_big("nothing_to_summarize", history(), keep_tokens=1000)
    assert summarizer.calls == []
    _expect_too_big("nothing_to_summarize", [user("only", "u")])


def test_empty_summary_without_truncation_is_a_server_error() -> None:
    with pytest.raises(CompactionError) as info:
        do_compact(history(), Summarizer("  "))
    assert info.value.status == 500 and info.value.code is None


def test_compact_rejects_bad_limits() -> None:
    bad: list[dict[str, Any]] = [
        {"keep_tokens": 0},
        {"max_output_tokens": 0},
        {"max_output_tokens": 16385},
    ]
    for kw in bad:
        with pytest.raises(CompactionError) as info:
            do_compact(history(), **kw)
        assert info.value.status == 400 and info.value.code is None


def test_default_keep_tokens() -> None:
    assert default_keep_tokens(32768) == 2048
    assert default_keep_tokens(1 << 20) == 8192
    assert default_keep_tokens(8) == 1


def test_summary_messages_render_any_conversation() -> None:
    messages = summary_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "SECRET THOUGHTS"},
        ]
    )
    assert [m["role"] for m in messages] == ["system", "user"]
    body = messages[1]["content"]
    assert "User:\nlook\n[image]" in body and "Assistant:\nok" in body
    assert "SECRET THOUGHTS" not in body


# ---------------------------------------------------------------- context_management


def test_needs_compaction_and_output_budget() -> None:
    assert needs_compaction(100, threshold=100, context_window=1000)
    assert not needs_compaction(99, threshold=100, context_window=1000)
    assert needs_compaction(1000, threshold=COMPACT_THRESHOLD_MAX, context_window=1000)
    assert output_budget(1000, 900, None) == 100
    assert output_budget(1000, 900, 50) == 50
    assert output_budget(1000, 1200, 50) == 0


def test_auto_compact() -> None:
    items = history()
    started: list[int] = []

    def on_start(tokens: int) -> None:
        started.append(tokens)

    def auto(threshold: int, summarizer: Summarizer, window: int = 4096) -> Any:
        return run(
            auto_compact(
                items,
                threshold=threshold,
                count_tokens=async_words,
                summarize=summarizer,
                to_messages=to_messages,
                context_window=window,
                on_start=on_start,
            )
        )

    below = Summarizer()
    assert auto(words(items) + 1, below) is None and below.calls == [] and started == []
    reached = Summarizer()
    result = auto(words(items), reached)
    assert result is not None and started == [words(items)]
    assert ids(result.history)[:2] == ["sys", "compaction"]
    assert result.input_tokens_after < result.input_tokens_before
    # keep_tokens is at most half the threshold, so small thresholds still compact
    assert words(result.plan.kept_items) <= words(items) // 2
    # nothing old enough to summarize, but room left: generate without compacting
    started.clear()
    assert auto(1, Summarizer(), window=4096) is not None  # keep_tokens 1: only u3 is kept
    short = [user("hi", "u")]
    assert (
        run(
            auto_compact(
                short,
                threshold=1,
                count_tokens=words,
                summarize=Summarizer(),
                to_messages=to_messages,
                context_window=100,
            )
        )
        is None
    )
    # no room for output and nothing to compact: the error stands
    with pytest.raises(CompactionError) as info:
        run(
            auto_compact(
                short,
                threshold=COMPACT_THRESHOLD_MAX,
                count_tokens=words,
                summarize=Summarizer(),
                to_messages=to_messages,
                context_window=words(short),
            )
        )
    assert info.value.code == CONTEXT_LENGTH_EXCEEDED


# ---------------------------------------------------------------- request fields


def test_parse_compact_request_defaults_and_extras() -> None:
    request = parse_compact_request(
        {"model": "m", "input": "hello", "stream": False, "temperature": 0.2}
    )
    assert request.model == "m" and request.keep_tokens is None
    assert request.max_output_tokens == 1024
    assert request.extra == {"temperature": 0.2}
    assert request.items == [{"type": "message", "role": "user", "content": "hello"}]
    request = parse_compact_request(
        {"input": [{"role": "user", "content": "x"}], "keep_tokens": 5, "max_output_tokens": 16384}
    )
    assert request.keep_tokens == 5 and request.max_output_tokens == 16384
    assert request.items[0]["type"] == "message"
    assert parse_compact_request({"input": "x", "max_output_tokens": 1}).max_output_tokens == 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "stream": True}, "stream"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "conversation": {"id": "conv_1"}}, "conversation"),
        ({"input": "x", "keep_tokens": 0}, "keep_tokens"),
        ({"input": "x", "keep_tokens": -3}, "keep_tokens"),
        ({"input": "x", "keep_tokens": "5"}, "keep_tokens"),
        ({"input": "x", "keep_tokens": True}, "keep_tokens"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 16385}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10.5}, "max_output_tokens"),
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": "x", "model": 3}, "model"),
        ({"input": "x", "instructions": ["a"]}, "instructions"),
    ],
)
def test_parse_compact_request_400s(body: dict[str, Any], param: str) -> None:
    with pytest.raises(CompactionError) as info:
        parse_compact_request(body)
    assert info.value.status == 400 and info.value.code is None
    assert info.value.extra["param"] == param
    assert "\n" not in info.value.message


def test_parse_compact_request_rejects_a_non_object() -> None:
    with pytest.raises(CompactionError):
        parse_compact_request(["input"])


def test_parse_context_management() -> None:
    assert parse_context_management(None) is None
    assert parse_context_management([]) is None
    assert parse_context_management([{"type": "compaction", "compact_threshold": 1}]) == 1
    top = [{"type": "compaction", "compact_threshold": COMPACT_THRESHOLD_MAX}]
    assert parse_context_management(top) == COMPACT_THRESHOLD_MAX
    assert parse_context_management([{"type": "compaction"}]) == COMPACT_THRESHOLD_MAX


@pytest.mark.parametrize(
    "value",
    [
        {"type": "compaction", "compact_threshold": 5},
        "compaction",
        ["compaction"],
        [{"type": "truncation", "compact_threshold": 5}],
        [{"compact_threshold": 5}],
        [{"type": "compaction", "compact_threshold": 0}],
        [{"type": "compaction", "compact_threshold": COMPACT_THRESHOLD_MAX + 1}],
        [{"type": "compaction", "compact_threshold": "100"}],
        [{"type": "compaction", "compact_threshold": 5.0}],
        [{"type": "compaction", "compact_threshold": True}],
        [{"type": "compaction", "compact_threshold": 5}, {"type": "compaction"}],
    ],
)
def test_parse_context_management_400s(value: Any) -> None:
    with pytest.raises(CompactionError) as info:
        parse_context_management(value)
    assert info.value.status == 400 and info.value.code is None
    assert info.value.extra["param"].startswith("context_management")


# ---------------------------------------------------------------- property


@st.composite
def histories(draw: st.DrawFn) -> list[Item]:
    items: list[Item] = []
    serial = iter(range(10_000))

    def ident(prefix: str) -> str:
        return f"{prefix}{next(serial)}"

    if draw(st.booleans()):
        sealed = compaction_item("old summary", [])
        items.append({**sealed, EXPANDED_KEY: True})
    for kind in draw(
        st.lists(st.sampled_from(["turn", "turn", "tools", "system", "developer"]), max_size=12)
    ):
        size = draw(st.integers(0, 12))
        if kind in ("system", "developer"):
            items.append(msg(kind, filler(size), ident("s")))
        elif kind == "turn":
            items.append(user(filler(size), ident("u")))
            if draw(st.booleans()):
                items.append({"type": "reasoning", "id": ident("r"), "content": []})
            items.append(assistant(filler(draw(st.integers(0, 12))), ident("a")))
        else:
            calls = [ident("c") for _ in range(draw(st.integers(1, 3)))]
            for call_id in calls:
                items.append(call(call_id, filler(draw(st.integers(0, 6)))))
            order = draw(st.permutations(calls))
            for call_id in order:
                items.append(output(call_id, filler(draw(st.integers(0, 6)))))
            if draw(st.booleans()):
                items.append(assistant(filler(size), ident("a")))
    if draw(st.booleans()):
        items.append(call(ident("pending")))  # a call still waiting for its output
    return items


def _position(items: list[Item]) -> dict[int, int]:
    return {id(item): index for index, item in enumerate(items)}


@settings(max_examples=150, deadline=None)
@given(items=histories(), keep=st.integers(1, 80))
def test_plan_partitions_the_history(items: list[Item], keep: int) -> None:
    plan: CompactionPlan = run(plan_compaction(items, count_tokens=words, keep_tokens=keep))
    where = _position(items)
    parts = (plan.system_items, plan.to_summarize, plan.kept_items)
    # each part is in input order, and together they hold every item exactly once
    for part in parts:
        positions = [where[id(item)] for item in part]
        assert positions == sorted(positions)
    assert sorted(where[id(item)] for part in parts for item in part) == list(range(len(items)))
    assert all(item["role"] in ("system", "developer") for item in plan.system_items)
    others = [item for item in plan.to_summarize + plan.kept_items if item["type"] == "message"]
    assert not any(item["role"] in ("system", "developer") for item in others)
    # no function_call is separated from its output; pending calls are kept
    summarized = {item.get("call_id") for item in plan.to_summarize if "call_id" in item}
    kept = {item.get("call_id") for item in plan.kept_items if "call_id" in item}
    assert not summarized & kept
    assert not any(str(call_id).startswith("pending") for call_id in summarized)
    # the last user message is kept; compaction items are not
    users = [item for item in items if item["type"] == "message" and item["role"] == "user"]
    if users:
        assert any(item is users[-1] for item in plan.kept_items)
    assert not any(item["type"] == "compaction" for item in plan.kept_items)
    # apart from the pinned user message, the kept items are a suffix of the history
    rest = [item for item in plan.kept_items if not (users and item is users[-1])]
    kept_ids = {id(item) for item in plan.kept_items}
    non_system = [item for item in items if not any(item is s for s in plan.system_items)]
    if rest:
        start = next(i for i, item in enumerate(non_system) if item is rest[0])
        assert all(id(item) in kept_ids for item in non_system[start:])
