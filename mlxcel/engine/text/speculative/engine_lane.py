"""Speculative decoding as a lane of the engine core.

While exactly one sequence holds a slot and it may speculate (greedy, no logits processor:
`Speculator.eligible`), it leaves the batch for a `SoloLane` that drafts tokens (prompt
lookup or a draft model) and verifies them in one forward per round; when another sequence
arrives, or the policy stops drafting, it goes back into the batch. Each step the core asks
this lane first (`step`): True means the lane took the step, else the batch steps.

What the lane needs of the core's batch is the `BatchSide` protocol: the lone batched
sequence, taking it out and putting it back, and the core's token pipeline for the tokens
the lane emits, so the output is the same token for token as the batch would give.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from mlxcel.engine.text.speculative.lane import LaneToken, SoloLane, Speculator

if TYPE_CHECKING:
    from mlxcel.engine.text.engine_state import EngineCounters
    from mlxcel.engine.text.running_sequence import RunningSequence


class BatchSide(Protocol):
    """The engine core as the speculative lane sees it (engine thread only)."""

    @property
    def counters(self) -> EngineCounters: ...

    def n_running(self) -> int:
        """Sequences holding a slot."""
        ...

    def lone_sequence(self) -> RunningSequence | None:
        """The one sequence decoding in the batch when it is the only one holding a slot."""
        ...

    def leave_batch(self, job: RunningSequence) -> tuple[Any, Any] | None:
        """Forget `job`'s batch row (not its generator entry); the token and row the batch
        sampler already drew for it, when it knows them."""
        ...

    def rejoin_batch(self, generator: Any, job: RunningSequence, lane: SoloLane) -> None:
        """Hand `job` back from `lane` into the generator, as a batched row again."""
        ...

    def eos_of(self, job: RunningSequence) -> frozenset[int] | tuple[()]:
        """The tokens that end `job` (none when it ignores end-of-generation)."""
        ...

    def deliver(self, generator: Any, job: RunningSequence, token: LaneToken, now: float) -> None:
        """Send one token through the core's token pipeline."""
        ...


class SpeculativeLane:
    """The core's speculative lane: when a sequence enters and leaves it, and its rounds."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator
        self.lane: SoloLane | None = None  # the lane running `job`
        self.job: RunningSequence | None = None
        self._mark: tuple[int, int, float] | None = None  # (uid, n_generated, time)

    def admit(self, job: RunningSequence, processors: list[Any]) -> None:
        """Give `job` its speculation state when it may speculate."""
        if self.speculator.eligible(job.request, processors):
            job.spec = self.speculator.sequence()
            job.spec.history = list(job.request.prompt_tokens)

    def step(self, core: BatchSide, generator: Any) -> bool:
        """Run a round when one sequence decodes alone and the policy drafts (or the lane has
        a pending token); False: the batch steps."""
        lane, job = self.lane, self.job
        if lane is None or job is None:
            job = core.lone_sequence()
            if job is None:
                self._mark = None
                return False
            seq = job.spec
            if seq is None:
                return False
            self._time_plain_step(job)
            budget = job.max_tokens - job.n_generated
            if (
                job.n_generated < seq.enter_at
                or budget < 2
                or not self.speculator.wants_lane(seq, budget)
            ):
                return False
            self._mark = None
            pending = core.leave_batch(job)
            lane = self.speculator.enter(generator, job.uid, seq, job.sampler, pending)
            self.lane, self.job = lane, job
        elif core.n_running() > 1 or not lane.plan(job.max_tokens - job.n_generated):
            self._leave(core, generator)
            return False
        self._round(core, generator, lane, job)
        return True

    def release(self, job: RunningSequence) -> tuple[list[Any], list[int]] | None:
        """End the lane if it runs `job`: its KV cache and the tokens it holds."""
        if job is not self.job or self.lane is None:
            return None
        held = self.lane.release()
        self.lane = self.job = None
        return held

    def forget(self, job: RunningSequence) -> None:
        """`job` finished: the lane no longer runs it."""
        if job is self.job:
            self.lane = self.job = None

    def _time_plain_step(self, job: RunningSequence) -> None:
        """What a plain step costs: the time between two batch steps that each gave the
        lone sequence one token (what drafting must beat)."""
        now = time.perf_counter()
        mark = self._mark
        if mark is not None and mark[0] == job.uid and mark[1] == job.n_generated - 1:
            self.speculator.costs.record(0, now - mark[2])
        self._mark = (job.uid, job.n_generated, now)

    def _round(self, core: BatchSide, generator: Any, lane: SoloLane, job: RunningSequence) -> None:
        start = time.perf_counter()
        tokens = lane.round(job.max_tokens - job.n_generated)
        now = time.perf_counter()
        c = core.counters
        c.decode_steps += 1
        c.busy_slots_per_decode_total += 1
        c.decode_seconds_total += now - start
        eos = core.eos_of(job)
        for token, row in tokens:
            r = LaneToken(token, row)
            if job.n_generated + 1 >= job.max_tokens:
                r.finish_reason = "length"
            if token in eos:
                r.finish_reason = "stop"
            if r.finish_reason is not None:
                r.prompt_cache, r.all_tokens = lane.release()
            core.deliver(generator, job, r, now)
            if job.finished:
                return

    def _leave(self, core: BatchSide, generator: Any) -> None:
        """Hand the lane's sequence back to the batch."""
        lane, job = self.lane, self.job
        self.lane = self.job = None
        if lane is None or job is None or job.finished:
            return
        core.rejoin_batch(generator, job, lane)
