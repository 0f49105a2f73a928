"""Loop detection over generated tokens and the policy that picks its parameters."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.config.process_env import LOOP_DETECTION
from mlxcel.engine.text.loop_detection import (
    DEFAULT_LOOP,
    MAX_PATTERN_SIZE,
    LoopDetector,
    LoopParams,
    parse_loop_env,
    resolve_loop_params,
)

GEMMA = LoopParams(max_pattern_size=20, min_pattern_size=1, min_count=4)


def first_hit(params: LoopParams, tokens: Sequence[int]) -> int | None:
    """1-based number of tokens pushed when the detector first fires."""
    detector = LoopDetector(params)
    for n, token in enumerate(tokens, 1):
        if detector.push(token):
            return n
    return None


def naive_looping(tail: Sequence[int], params: LoopParams) -> bool:
    for p in range(params.min_size, params.max_pattern_size + 1):
        span = p * params.min_count
        if len(tail) >= span:
            window = tail[-span:]
            if all(window[i] == window[i % p] for i in range(span)):
                return True
    return False


def test_repeated_pattern_fires_exactly_at_the_last_repeat() -> None:
    assert first_hit(GEMMA, [1, 2, 3] * 4) == 12
    assert first_hit(GEMMA, [9, 8] + [5] * 4) == 6
    assert first_hit(GEMMA, [0, 1, 2, 3, 4] + [7, 7, 8] * 5) == 5 + 12


def test_no_loop_no_fire() -> None:
    assert first_hit(GEMMA, [1, 2, 3] * 3 + [1, 2]) is None
    assert first_hit(GEMMA, list(range(200))) is None
    assert first_hit(GEMMA, [1, 2, 3] * 3 + [4] + [1, 2, 3]) is None
    # A pattern longer than max_pattern_size is not detected.
    assert first_hit(LoopParams(4, 1, 4), [1, 2, 3, 4, 5] * 6) is None
    assert first_hit(LoopParams(5, 1, 4), [1, 2, 3, 4, 5] * 6) == 20


def test_min_pattern_size_and_count() -> None:
    # One token repeated 4 times is not a pattern of length >= 2 ...
    assert first_hit(LoopParams(20, 2, 4), [7] * 7) is None
    # ... but 8 of them are "7 7" four times.
    assert first_hit(LoopParams(20, 2, 4), [7] * 8) == 8
    assert first_hit(LoopParams(20, 2, 4), [1, 2, 3] * 4) == 12
    assert first_hit(LoopParams(20, 0, 4), [7] * 4) == 4  # 0 means 1
    assert first_hit(LoopParams(20, 1, 2), [1, 2, 1, 2]) == 4
    assert first_hit(LoopParams(20, 1, 6), [1, 2] * 5) is None


def test_disabled_parameters_never_fire() -> None:
    for params in (LoopParams(0, 1, 4), LoopParams(20, 1, 1), LoopParams(20, 1, 0)):
        assert not params.enabled
        assert first_hit(params, [1] * 100) is None


def test_reset_forgets_the_history() -> None:
    detector = LoopDetector(GEMMA)
    for token in [4, 4, 4]:
        assert not detector.push(token)
    detector.reset()
    assert not any(detector.push(4) for _ in range(3))
    assert detector.push(4)


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError, match="min_pattern_size"):
        LoopDetector(LoopParams(3, 5, 4))
    with pytest.raises(ValueError, match="min_count"):
        LoopDetector(LoopParams(3, 1, -1))


def test_max_pattern_size_is_bounded() -> None:
    """The detector's lists are `max_pattern_size` long: 2**64 from a request grew one until
    the kernel killed the server. Over `MAX_PATTERN_SIZE` is refused before anything is
    built (the engine never sees it)."""
    LoopParams(MAX_PATTERN_SIZE, 1, 4).validate()
    for size in (MAX_PATTERN_SIZE + 1, 2**64):
        with pytest.raises(ValueError, match=f"at most {MAX_PATTERN_SIZE}"):
            resolve_loop_params(max_pattern_size=size)
        with pytest.raises(ValueError, match="max_pattern_size"):
            parse_loop_env(f"{size},1,4")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(st.integers(0, 2), max_size=60),
    st.integers(0, 6),
    st.integers(0, 3),
    st.integers(0, 5),
)
def test_matches_brute_force(tokens: list[int], size_max: int, size_min: int, count: int) -> None:
    params = LoopParams(size_max, min(size_min, size_max), count)
    detector = LoopDetector(params)
    for n, token in enumerate(tokens, 1):
        expected = params.enabled and naive_looping(tokens[:n], params)
        assert detector.push(token) == expected


# -- policy ------------------------------------------------------------------------------


def test_family_default_and_off_otherwise() -> None:
    assert resolve_loop_params(model_family="gemma4") == GEMMA
    assert resolve_loop_params(model_family="Gemma4") == GEMMA
    assert resolve_loop_params(model_family="llama") is None
    assert resolve_loop_params() is None


def test_env_overrides_the_family_default() -> None:
    assert resolve_loop_params(env_value="off", model_family="gemma4") is None
    assert resolve_loop_params(env_value="0", model_family="gemma4") is None
    assert resolve_loop_params(env_value="30,2,3", model_family="gemma4") == LoopParams(30, 2, 3)
    assert resolve_loop_params(env_value="30,2,3") == LoopParams(30, 2, 3)
    assert resolve_loop_params(env_value="on") == DEFAULT_LOOP
    assert resolve_loop_params(env_value="  ", model_family="gemma4") == GEMMA
    assert resolve_loop_params(env_value="", model_family=None) is None
    # Named fields; the others come from the family default (or DEFAULT_LOOP).
    assert resolve_loop_params(env_value="count=6", model_family="gemma4") == LoopParams(20, 1, 6)
    assert resolve_loop_params(env_value="MAX = 8, min=2") == LoopParams(8, 2, 4)
    assert resolve_loop_params(env_value="max=0") is None


def test_request_values_win() -> None:
    # Any field set in the request wins over env and family, even to turn it off.
    assert resolve_loop_params(max_pattern_size=0, env_value="on", model_family="gemma4") is None
    assert resolve_loop_params(min_count=1, model_family="gemma4") is None
    assert resolve_loop_params(10, 2, 3, env_value="30,1,5", model_family="gemma4") == LoopParams(
        10, 2, 3
    )
    # Unset request fields come from the env / family result.
    assert resolve_loop_params(min_count=6, env_value="30,2,3") == LoopParams(30, 2, 6)
    assert resolve_loop_params(min_count=6, model_family="gemma4") == LoopParams(20, 1, 6)
    assert resolve_loop_params(max_pattern_size=12) == LoopParams(12, 1, 4)
    # ... even when the env turned detection off.
    assert resolve_loop_params(min_count=3, env_value="off") == LoopParams(20, 1, 3)
    with pytest.raises(ValueError, match="min_pattern_size"):
        resolve_loop_params(max_pattern_size=3, min_pattern_size=5)
    with pytest.raises(ValueError, match="max_pattern_size"):
        resolve_loop_params(max_pattern_size=-1)


@pytest.mark.parametrize(
    "value",
    ["maybe", "20,1", "20,1,4,5", "a,b,c", "max=x", "size=3", "max=3,max=4", "2,9,4", "-1,1,4"],
)
def test_malformed_env_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=LOOP_DETECTION):
        resolve_loop_params(env_value=value, model_family="gemma4")
    with pytest.raises(ValueError, match=LOOP_DETECTION):
        parse_loop_env(value)
