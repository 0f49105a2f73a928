"""A follower rank's engine against steps it cannot apply, without a group: a stand-in lane
hands it rank 0's steps. A step that admits into a slot already busy on this rank (the ranks
out of step) breaks the group with a reason; the follower reports it (a non-zero exit)
rather than dying as if rank 0 had stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxcel.engine.distributed.lane import StepInputs
from mlxcel.engine.loading import load_model
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.request import GenerationRequest
from mlxcel.engine.text.scheduler import TextEngine


class _ScriptedLane:
    """A follower's lane whose steps come from a list (then a stop); collectives are local."""

    leader = False
    heartbeat = 0.1

    def __init__(self, steps: list[StepInputs]) -> None:
        self.steps = steps
        self.failure: str | None = None
        self.on_broken: Callable[[str], None] | None = None
        self.prefixes: list[int] = []  # the cached prefixes this rank agreed on

    def share(self, inputs: StepInputs | None = None) -> StepInputs:
        return self.steps.pop(0) if self.steps else StepInputs(stop=True)

    def agree_min(self, values: list[int]) -> list[int]:
        return values

    def agree_prefix(self, n: int) -> tuple[int, int]:
        self.prefixes.append(n)
        return n, n

    def shared_sampler(
        self, sampler: Callable[[mx.array], mx.array]
    ) -> Callable[[mx.array], mx.array]:
        return sampler

    @contextmanager
    def collective(self) -> Iterator[None]:
        yield

    def broken(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            if self.on_broken is not None:
                self.on_broken(reason)

    def close(self) -> None:
        pass


def _request(request_id: str) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=[1, 2, 3, 4],
        max_tokens=50,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_prompt=True,
        request_id=request_id,
    )


def _follow(
    tiny_llama_dir: Path, steps: list[StepInputs], lane: Any = None, prompt_cache: Any = None
) -> str | None:
    lane = lane or _ScriptedLane(steps)
    engine = TextEngine(
        load_model(str(tiny_llama_dir)), slots=2, distributed=lane, prompt_cache=prompt_cache
    )
    try:
        return engine.follow()
    finally:
        engine.stop()


def test_a_step_into_a_busy_slot_breaks_the_group(tiny_llama_dir: Path) -> None:
    busy = [
        StepInputs(admitted=[(_request("a"), 0, 50)]),
        StepInputs(admitted=[(_request("b"), 0, 50)]),  # slot 0 is a's on this rank
    ]
    failure = _follow(tiny_llama_dir, busy)
    assert failure is not None and "slot 0" in failure and "could not be applied" in failure


def test_steps_in_step_end_with_rank_0s_stop(tiny_llama_dir: Path) -> None:
    steps = [
        StepInputs(admitted=[(_request("a"), 0, 50)]),
        StepInputs(admitted=[(_request("b"), 1, 50)]),
        StepInputs(cancelled=["a"]),
        StepInputs(admitted=[(_request("c"), 0, 50)]),
    ]
    assert _follow(tiny_llama_dir, steps) is None


class _BrokenCache:
    """A prompt cache whose lookups fail on this rank (a damaged entry, memory)."""

    def lookup(self, tokens: list[int], slot: int | None = None) -> tuple[None, int]:
        raise MemoryError("no memory for the cached prefix")

    def insert(self, tokens: list[int], cache: list[Any], slot: int | None = None) -> bool:
        return False


def test_a_failed_cache_lookup_still_takes_part_in_the_prefix_agreement(
    tiny_llama_dir: Path,
) -> None:
    lane = _ScriptedLane([StepInputs(admitted=[(_request("a"), 0, 50)])])
    assert _follow(tiny_llama_dir, [], lane, _BrokenCache()) is None
    assert lane.prefixes == [0]  # this rank agreed (on nothing cached), as rank 0 waits for


def test_every_rank_samples_batched_whatever_its_environment(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLXCEL_BATCHED_SAMPLING", "0")  # on this host only, say
    lane: Any = _ScriptedLane([])
    loaded = load_model(str(tiny_llama_dir))
    assert TextEngine(loaded, distributed=lane).batched_sampling
    assert not TextEngine(loaded).batched_sampling
