"""Stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.engine.text.stops import StopMatcher


def reference(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """What a character-by-character reader emits: cut at the first position a stop ends."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(len(s) for s in ending)], True
    return text, False


def run(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, bool]:
    """Feed `pieces` one by one; flush at the end unless a stop matched."""
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(matcher.flush())
    return "".join(out), False


CASES = [
    ("Hello ### world", ["###"]),
    ("Hello ## # world", ["###"]),
    ("abcd", ["abcd", "bc"]),
    ("xxabcabd", ["abd", "abcabd"]),
    ("aaab", ["aab"]),
    ("<|im_end|> tail", ["<|im_end|>", "<|endoftext|>"]),
    ("no stop in here", ["STOP", "halt"]),
    ("ends with a partial ST", ["STOP"]),
    ("naïve café ☕ done ☕☕", ["☕☕", "é ☕ x"]),
    ("User: hi\nUser:", ["\nUser:"]),
]


@pytest.mark.parametrize(("text", "stops"), CASES)
def test_every_split_emits_the_same_text(text: str, stops: list[str]) -> None:
    expected = reference(text, stops)
    assert run([text], stops) == expected
    assert run(list(text), stops) == expected
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], stops) == expected
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            assert run([text[:a], text[a:b], text[b:]], stops) == expected


def test_hand_examples() -> None:
    assert reference("Hello ### world", ["###"]) == ("Hello ", True)
    # First to finish wins: "bc" ends before "abcd" does.
    assert reference("abcd", ["abcd", "bc"]) == ("a", True)
    # Ending at the same place, the longer stop wins.
    assert reference("xxabcabd", ["abd", "abcabd"]) == ("xx", True)


def test_holds_back_a_possible_stop_and_releases_it() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.feed("Hello #") == ("Hello ", False)
    assert matcher.held == "#"
    assert matcher.feed("#") == ("", False)
    assert matcher.feed("!") == ("##!", False)
    assert matcher.feed("##") == ("", False)
    assert matcher.flush() == "##"
    assert matcher.flush() == ""


def test_match_emits_text_before_the_stop_and_then_nothing() -> None:
    matcher = StopMatcher(["</s>", "###"])
    assert matcher.feed("answer </") == ("answer ", False)
    assert matcher.feed("s> more") == ("", True)
    assert matcher.matched == "</s>" and matcher.done
    assert matcher.feed("again") == ("", True)
    assert matcher.flush() == ""


def test_no_stops_and_empty_stops_pass_text_through() -> None:
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.feed("abc") == ("abc", False)
        assert matcher.feed("") == ("", False)
        assert matcher.flush() == ""


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.text(alphabet="ab#\n", max_size=24),
    st.lists(st.text(alphabet="ab#\n", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(0, 24), max_size=6),
)
def test_random_splits_match_the_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert run(pieces, stops) == reference(text, stops)
