"""The engine's distributed lane: rank 0's step inputs reach every rank, and every rank
runs the same batched forwards.

Rank 0 runs the scheduler. At the top of every engine step it sends the step's inputs
(`StepInputs`: the requests it admitted, in order, with their slots; the requests it
cancelled; whether it stops) to the other ranks, which apply them to their own copy of
the engine core: the same admissions into the same slots, so the same `DecodeBatch` calls
and the same forwards (tensor parallel: the layers' sums across ranks; pipeline parallel:
the hidden state passed rank to rank). Three more agreements keep the ranks in step:

- the tokens: every sampler call's tokens are rank 0's (`shared_sampler`), so a request's
  sequence, its stop strings and its end are the same everywhere;
- the prompt cache: each rank has its own (holding its own shard of the KV), and a request
  starts from the longest prefix *every* rank holds (`agree_prefix`);
- liveness: when idle, rank 0 sends an empty step every `heartbeat` seconds, so a rank
  that died is noticed; a collective that fails ("connection to a peer was lost") or that
  has not returned within `timeout` seconds (a watchdog thread) breaks the lane: rank 0's
  engine fails its requests and refuses new ones (`GroupBrokenError`, HTTP 503) and
  `/health` answers 503. A follower whose rank 0 is gone stops with an error; one whose
  rank 0 froze with its connections open (no step for `timeout` seconds, though rank 0
  sends one every `heartbeat` when idle) is blocked in a collective that nothing can
  interrupt, so its watchdog ends the process (exit 1).

Every collective runs on the engine thread, over mx.distributed, on the stream the forwards
run on (mlx-lm's `generation_stream`): collectives on two streams would run concurrently
and meet each other out of order across ranks. The bytes of a step are an all_sum of a
uint8 array that only rank 0 fills, after an all_sum of its size (0 for a step with no
new inputs: nothing more is sent).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NoReturn

from mlxcel.engine.distributed.group import GroupBrokenError, Ranks

if TYPE_CHECKING:
    import mlx.core as mx

    from mlxcel.engine.text.request import GenerationRequest

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 1.0


@dataclass
class StepInputs:
    """What rank 0 decided before one engine step."""

    admitted: list[tuple[GenerationRequest, int, int]] = field(default_factory=list)
    """The requests admitted, in order: each with its slot and its token budget."""
    cancelled: list[str] = field(default_factory=list)
    stop: bool = False


def other_ranks(rank: int, size: int) -> str:
    """The ranks of a group of `size` but `rank`, in words ("rank 1", "rank 0 or 2",
    "rank 0, 1 or 3"): a stalled collective says only that one of them stopped answering,
    not which."""
    others = [str(r) for r in range(size) if r != rank]
    if len(others) <= 1:
        return f"rank {''.join(others)}"
    return f"rank {', '.join(others[:-1])} or {others[-1]}"


def follower_copy(request: GenerationRequest) -> GenerationRequest:
    """The part of `request` a follower runs: the sampled tokens are rank 0's, so what only
    shapes sampling (a grammar, a thinking budget) stays on rank 0."""
    return replace(request, grammar=None, thinking=None)


def _stream() -> mx.ThreadLocalStream:
    """The stream the batched forwards run on."""
    from mlx_lm.generate import generation_stream

    stream: mx.ThreadLocalStream = generation_stream
    return stream


class DistributedLane:
    """One rank's side of the step exchange (engine thread only, but `failure`)."""

    def __init__(self, ranks: Ranks, *, timeout: float, heartbeat: float = HEARTBEAT_SECONDS):
        self.ranks = ranks
        self.timeout = timeout
        self.heartbeat = min(heartbeat, timeout / 4)
        self.failure: str | None = None
        self.on_broken: Callable[[str], None] | None = None  # set by the engine
        self._since: float | None = None  # when the collective in progress began
        self._lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()

    @property
    def leader(self) -> bool:
        return self.ranks.leader

    def start_watchdog(self) -> None:
        """Watch every collective against `timeout` (idempotent)."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._watch, name="mlxcel-distributed-watchdog", daemon=True
            )
            self._watchdog.start()

    def close(self) -> None:
        self._closed.set()

    # ------------------------------------------------------------ step exchange

    def share(self, inputs: StepInputs | None = None) -> StepInputs:
        """Rank 0: send `inputs` to every rank and return them; another rank: receive
        rank 0's (GroupBrokenError when the group is broken)."""
        import mlx.core as mx
        import numpy as np

        # A plain decode step has nothing to send: its size 0 is the whole exchange.
        payload = pickle.dumps(inputs) if self.leader and inputs != StepInputs() else b""
        with self.collective():
            size = self._sum(mx.array([len(payload)], dtype=mx.int32))
            n = int(np.array(size)[0])
            if n == 0:
                received = None
            elif self.leader:
                received = np.array(self._sum(mx.array(np.frombuffer(payload, dtype=np.uint8))))
            else:
                received = np.array(self._sum(mx.zeros((n,), dtype=mx.uint8)))
        if self.leader:
            assert inputs is not None
            return inputs
        if received is None:
            return StepInputs()
        shared: StepInputs = pickle.loads(received.tobytes())
        return shared

    def agree_prefix(self, n: int) -> tuple[int, int]:
        """(the least, the most) of every rank's `n` (a cached prefix's length)."""
        low, neg_high = self.agree_min([n, -n])
        return low, -neg_high

    def agree_min(self, values: list[int]) -> list[int]:
        """The least of every rank's `values`, element by element."""
        import mlx.core as mx
        import numpy as np

        with self.collective():
            least = mx.distributed.all_min(
                mx.array(values, dtype=mx.int64), group=self.ranks.group, stream=_stream()
            )
            return [int(v) for v in np.array(least)]

    def shared_sampler(
        self, sampler: Callable[[mx.array], mx.array]
    ) -> Callable[[mx.array], mx.array]:
        """`sampler`, its tokens replaced by rank 0's (one all_sum in the step's graph)."""
        import mlx.core as mx

        group = self.ranks.group
        leader = self.leader

        def sample(logprobs: mx.array) -> mx.array:
            tokens = sampler(logprobs)
            mine = tokens if leader else mx.zeros_like(tokens)
            return mx.distributed.all_sum(mine, group=group, stream=_stream())

        return sample

    # --------------------------------------------------------------- liveness

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Around a collective: time it for the watchdog; a failure breaks the lane."""
        if self.failure is not None:
            raise GroupBrokenError(self.failure)
        with self._lock:
            self._since = time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # the ring backend: "connection to a peer was lost"
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "collective failed"
            self.broken(f"a rank of the distributed group is gone ({reason})")
            raise GroupBrokenError(self.failure or reason) from None
        finally:
            with self._lock:
                self._since = None
        if self.failure is not None:  # the watchdog gave up on this one meanwhile
            raise GroupBrokenError(self.failure)

    def broken(self, reason: str) -> None:
        """Mark the group broken (once) and tell the engine."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("distributed group broken: %s", reason)
        if self.on_broken is not None:
            self.on_broken(reason)

    def _sum(self, array: mx.array) -> mx.array:
        import mlx.core as mx

        return mx.distributed.all_sum(array, group=self.ranks.group, stream=_stream())

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout / 4)):
            with self._lock:
                since = self._since
            if since is not None and time.monotonic() - since > self.timeout:
                if not self.leader:
                    self._leave_group()
                who = other_ranks(self.ranks.rank, self.ranks.size)
                self.broken(
                    f"{who} of the distributed group stopped answering "
                    f"(no reply within {self.timeout:g} s)"
                )
                return
            if self.failure is not None:
                return

    def _leave_group(self) -> NoReturn:
        """A follower whose step did not complete within `timeout` seconds (rank 0 froze,
        or with 3 ranks or more maybe another follower): its engine thread is blocked in a
        collective (native code, which no Python exception interrupts), so this ends the
        process, exit 1, after one line on stderr."""
        for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
            with suppress(OSError, ValueError):
                stream.flush()
        try:
            os.write(2, self.leave_line().encode())
        finally:
            os._exit(1)

    def leave_line(self) -> str:
        """The line a follower's watchdog prints before it ends the process: the ranks
        that may have stopped answering, as the collective cannot tell which one did."""
        who = other_ranks(self.ranks.rank, self.ranks.size)
        return (
            f"mlxcel: error: rank {self.ranks.rank}: no step for {self.timeout:g} s "
            f"({who} stopped answering); leaving the group\n"
        )


def lane_for(ranks: Ranks | None, timeout: float) -> DistributedLane | None:
    """The engine's lane for `ranks` (None alone), its watchdog running."""
    if ranks is None:
        return None
    lane = DistributedLane(ranks, timeout=timeout)
    lane.start_watchdog()
    return lane
