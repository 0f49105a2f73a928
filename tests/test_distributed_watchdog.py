"""The distributed watchdog's words: a stalled collective does not say which rank stopped
answering, so with 3 ranks or more its messages name every rank it may be, never one that
may well be alive (no group needed: the lane is given a stand-in one)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mlxcel.engine.distributed.group import Ranks
from mlxcel.engine.distributed.lane import DistributedLane, other_ranks


@pytest.mark.parametrize(
    ("rank", "size", "words"),
    [
        (0, 2, "rank 1"),
        (1, 2, "rank 0"),
        (0, 3, "rank 1 or 2"),
        (1, 3, "rank 0 or 2"),
        (2, 4, "rank 0, 1 or 3"),
    ],
)
def test_other_ranks_names_every_rank_but_this_one(rank: int, size: int, words: str) -> None:
    assert other_ranks(rank, size) == words


def _lane(rank: int, size: int, timeout: float = 3.0) -> DistributedLane:
    group: Any = object()  # the watchdog never touches the group
    return DistributedLane(Ranks(group, rank, size), timeout=timeout)


def test_a_follower_of_three_ranks_does_not_blame_rank_0_alone() -> None:
    # Rank 1's ring collective stalls when rank 2 freezes just as when rank 0 does.
    assert _lane(1, 3).leave_line() == (
        "mlxcel: error: rank 1: no step for 3 s (rank 0 or 2 stopped answering); "
        "leaving the group\n"
    )
    assert "(rank 0 stopped answering)" in _lane(1, 2).leave_line()


def test_rank_0s_watchdog_names_the_ranks_that_may_have_stopped() -> None:
    lane = _lane(0, 3, timeout=0.04)
    reasons: list[str] = []
    lane.on_broken = reasons.append
    lane._since = time.monotonic() - 1.0  # a collective in progress for longer than timeout
    lane._watch()  # returns once it has broken the lane
    assert reasons == [
        "rank 1 or 2 of the distributed group stopped answering (no reply within 0.04 s)"
    ]
    assert lane.failure == reasons[0]
