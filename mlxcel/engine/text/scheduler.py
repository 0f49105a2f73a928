"""The engine core: one thread owns the model and runs continuous batching.

`TextEngine` is the core for every model kind; `VisionEngine` (mlxcel.engine.vision.engine)
is the same core with its own step inputs (`_step_model`: which model the batched step
runs; `_start_cache`: how a prompt reaches the KV cache it starts from; `_cache_key`: how
the prompt cache names it), so the queue, admission and sleep exist once; every sequence's
tokens, whichever the kind, go through one `TokenPipeline` (token_pipeline.py: detokenizer,
stops, loop detection, logprobs, token/progress/final events, the finish counters). A
request it holds is a `RunningSequence` (running_sequence.py); what it shows the
observability routes is in engine_state.py.

Requests wait in a priority queue (`X-Priority`), are admitted into free slots, prefill
in chunks while other slots decode, and every decoding slot advances in one batched
forward per step (`DecodeBatch`, over mlx-lm's batch classes). Output goes back as
`GenerationEvent`s through a callback that the caller supplies (an asyncio queue bridge in
the server, a plain queue in the CLI).

Speculative decoding (`speculation=`): while exactly one sequence holds a slot and it is
greedy with no logits processor, it leaves the generator for a solo lane that drafts tokens
(prompt lookup or a draft model) and verifies them in one forward per round
(`mlxcel.engine.text.speculative.lane`); with two or more sequences, all decode batched.
That lane is one of the core's (`speculative.engine_lane.SpeculativeLane`): the core asks it
first each step and owns nothing of it; it sees the batch through `_BatchSide`.

Sampling is batched too: every sequence in the generator shares one `BatchSampler`, which
applies each row's settings as per-row arrays in one graph per step (`DecodeBatch` names
the rows of each call, `BatchRows` turns them into their sampling state).
`batched_sampling=False` (or `MLXCEL_BATCHED_SAMPLING=0`) gives each request its own
sampler instead, which mlx-lm then calls row by row.

A shared KV pool (`kv_pool=`, llama-server's `--kv-unified`): every slot may use up to the
whole context, and the tokens all running sequences hold in their KV caches together stay
within `kv_pool`. A step after which they would not fails every running sequence with a
context-exceeded error, its tokens unsent, as llama-server fails every processing slot
when its unified KV cache has no room for the next batch.

Distributed (`distributed=`, a `DistributedLane`): the model is one shard of a group of
ranks (`mlxcel.engine.distributed`). On rank 0 this core schedules as above and sends each
step's inputs to the other ranks before running it; on the others (`follow()`) the same
core takes its admissions and cancellations from rank 0 instead of its queue, so every rank
runs the same batched forwards; the sampled tokens are rank 0's everywhere.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Self, TypeVar

from mlxcel.config import process_env
from mlxcel.engine.errors import InvalidRequestError, QueueFullError
from mlxcel.engine.loading.model import LoadedModel, ModelInfo
from mlxcel.engine.mlx_threads import ThreadRun, run_pooled
from mlxcel.engine.process_memory import release_memory
from mlxcel.engine.text.engine_state import EngineCounters, EngineSnapshot, SlotState
from mlxcel.engine.text.memory_budget import AdmissionControl
from mlxcel.engine.text.request import FinishReason, GenerationEvent, GenerationRequest
from mlxcel.engine.text.running_sequence import EventSink, RunningSequence
from mlxcel.engine.text.sleep import (
    IdleSleep,
    Sleeps,
    reload_error,
    report_sleep,
    report_wake,
    resolve,
)
from mlxcel.engine.text.speculative import SpeculationConfig
from mlxcel.engine.text.submission import check_slot, iterate_events, token_budget
from mlxcel.engine.text.token_pipeline import TokenPipeline, count_finish
from mlxcel.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mlxcel.engine.distributed.lane import DistributedLane, StepInputs
    from mlxcel.engine.text.kv_types import KVType
    from mlxcel.engine.text.speculative.engine_lane import SpeculativeLane
    from mlxcel.engine.text.speculative.lane import LaneToken, SoloLane

log = logging.getLogger(__name__)


def _first_line(exc: Exception) -> str:
    """An exception's message as an event's error: its first line."""
    return str(exc).splitlines()[0] if str(exc) else ""


class EngineModel(Protocol):
    """What the core reads of a loaded model (`LoadedModel`, `LoadedVisionModel`): the
    network, its tokenizer and what it is. A dataclass: sleeping drops the network with
    `dataclasses.replace`."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    model: Any
    tokenizer: Tokenizer
    info: ModelInfo


LoadedT = TypeVar("LoadedT", bound=EngineModel)


class TextEngine(Sleeps, Generic[LoadedT]):
    """Continuous-batching generation over one loaded model."""

    flushes_sinks = True
    """Sinks with a `flush()` get it called after each iteration that gave them events."""

    def __init__(
        self,
        loaded: LoadedT,
        *,
        slots: int = 1,
        context_per_slot: int | None = None,
        kv_pool: int | None = None,
        prefill_chunk: int = 2048,
        max_queue_depth: int = 64,
        prompt_cache: Any = None,
        speculation: SpeculationConfig | None = None,
        batched_sampling: bool | None = None,
        sleep: IdleSleep | None = None,
        kv_type: KVType | None = None,
        distributed: DistributedLane | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError("slots must be >= 1")
        if distributed is not None and (speculation is not None or sleep is not None):
            raise ValueError(
                "a model split across ranks neither speculates nor sleeps on idle "
                "(--spec-type, --spec-draft-model, --sleep-idle-seconds)"
            )
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.n_slots = slots
        self.context_per_slot = context_per_slot or loaded.info.context_length
        self.kv_pool = kv_pool if slots > 1 else None  # one slot: its own limit is the pool
        self.prefill_chunk = max(16, prefill_chunk)
        self.max_queue_depth = max_queue_depth
        self.prompt_cache = prompt_cache
        self.counters = EngineCounters()
        self.kv_type = kv_type  # `-ctk/-ctv` (None: the model's dtype)
        self.memory = AdmissionControl(lambda: self.loaded.model, kv_type)
        self._cond = threading.Condition()
        self._pending: list[tuple[int, int, RunningSequence]] = []
        self._seq = itertools.count()
        self._jobs: dict[str, RunningSequence] = {}  # every queued or running job
        self._running: dict[str, RunningSequence] = {}  # jobs holding a slot
        self._by_uid: dict[int, RunningSequence] = {}  # running jobs by BatchGenerator uid
        self._free_slots = list(range(slots))
        self._used_slots: set[int] = set()
        self._cancelled: set[str] = set()
        self._stopping = False
        self._thread: ThreadRun | None = None
        self._eos_stops: Any = None
        self._no_stops: Any = None
        self._pipeline = TokenPipeline(loaded.tokenizer)
        self._alone: list[RunningSequence] = []  # prefilling alone (engine thread only)
        self._spec: SpeculativeLane | None = None  # engine thread only
        self._batch_side = _BatchSide(self)  # the batch as the speculative lane sees it
        if speculation is not None:
            self._spec = self._speculative_lane(speculation)
        if batched_sampling is None:
            # Every rank must make the same sampler calls (each one an all_sum), and each
            # host has its own environment: a split model always samples batched.
            batched_sampling = distributed is not None or process_env.batched_sampling()
        self.batched_sampling = batched_sampling
        self._batch_sampler: Any = None  # sampling.batched.BatchSampler (engine thread only)
        self._rows: Any = None  # batch_rows.BatchRows for the current generator
        self._sleep = sleep  # sleeping on idle (`--sleep-idle-seconds`); None: never
        self._lane = distributed
        self._step_sampler: Any = None  # the batch sampler as the generator calls it
        if distributed is not None:
            distributed.on_broken = self._group_broken

    # ---------------------------------------------------------------- public API

    def start(self) -> Self:
        """Start the engine thread (idempotent): a pooled one, reused by the next engine
        once this one stops (`mlx_threads`)."""
        if self._thread is None:
            self._thread = run_pooled(self._run, "mlxcel-engine")
        return self

    def stop(self) -> None:
        """Stop the engine thread; queued and active requests end as cancelled."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            waited = 0.0
            while self._thread.is_alive() and waited < 30:
                self._thread.join(timeout=0.5)
                waited += 0.5
                if self._lane is not None and self._lane.failure is not None:
                    break  # a collective of a broken group may never return
            self._thread = None
        if self._lane is not None:
            self._lane.close()
        self._end_sleep()

    def check(self, request: GenerationRequest) -> int:
        """Validate `request` against the model and context; return its token budget."""
        return token_budget(request, self.context_per_slot, self.tokenizer.vocab_size)

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue `request`; its events go to `sink` (called on the engine thread)."""
        budget = self.check(request)
        self.memory.admit(len(request.prompt_tokens), budget, self.prefill_chunk)
        self._queue(request, sink, budget)

    def _queue(self, request: GenerationRequest, sink: EventSink, budget: int) -> None:
        """Put a checked request in the priority queue (QueueFullError when it is full; an
        InvalidRequestError for a slot the engine does not have)."""
        check_slot(request, self.n_slots)
        job = RunningSequence(request=request, sink=sink, max_tokens=budget)
        job.flush = getattr(sink, "flush", None)
        with self._cond:
            if self._stopping:
                raise QueueFullError("the engine is shutting down")
            if self._lane is not None and self._lane.failure is not None:
                from mlxcel.engine.distributed.group import GroupBrokenError

                raise GroupBrokenError(self._lane.failure)
            if len(self._pending) >= self.max_queue_depth:
                raise QueueFullError("the prefill queue is full")
            if request.request_id in self._jobs:
                raise InvalidRequestError(f"duplicate request id {request.request_id}")
            self._jobs[request.request_id] = job
            if self._sleep is not None:
                self._sleep.touch()
            heapq.heappush(self._pending, (int(request.priority), next(self._seq), job))
            self._cond.notify_all()
        self.start()

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; its slot frees at the next step."""
        with self._cond:
            if request_id in self._jobs:
                self._cancelled.add(request_id)
                self._cond.notify_all()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Submit `request` and yield its events in order (for the CLI and tests)."""
        yield from iterate_events(self.submit, self.cancel, request)

    def forget_traffic(self) -> None:
        """Counters and slot usage back to a fresh engine's (after a warm-up request)."""
        with self._cond:
            self.counters = EngineCounters()
            self._used_slots.clear()

    def snapshot(self) -> EngineSnapshot:
        """Slots, queue and counters as of now."""
        with self._cond:
            busy = {job.slot: job for job in self._running.values()}
            slots = tuple(
                SlotState(
                    id=i,
                    state=("decoding" if busy[i].prefilled else "prefilling")
                    if i in busy
                    else "idle",
                    request_id=busy[i].request.request_id if i in busy else None,
                    n_prompt=len(busy[i].request.prompt_tokens) if i in busy else 0,
                    n_decoded=busy[i].n_generated if i in busy else 0,
                    used=i in self._used_slots,
                )
                for i in range(self.n_slots)
            )
            queued = tuple(job.request.request_id for _, _, job in sorted(self._pending))
            kv_name = self.kv_type.name if self.kv_type is not None else ""
            return EngineSnapshot(
                slots,
                queued,
                self.counters,
                self.context_per_slot,
                kv_name,
                self.memory.kv_bytes_per_token(),
                failure=(self._lane.failure or "") if self._lane is not None else "",
            )

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        # On a pooled thread that lives on: its MLX streams stay for the next engine.
        try:
            self._loop()
        finally:
            self._pipeline.flush_sinks()

    def _loop(self) -> None:
        if self._lane is not None and not self._lane.leader:
            self._follow()
            return
        generator = self._new_generator()
        admitted: list[RunningSequence] = []
        while True:
            self._pipeline.flush_sinks()  # the last iteration's events go out before any wait
            with self._cond:
                while not self._stopping and not self._pending and not self._running:
                    if self._cancelled:
                        break
                    if self._lane is not None:  # idle: an empty step every heartbeat
                        self._cond.wait(self._lane.heartbeat)
                        break
                    if not self._idle_wait():
                        break
                if self._stopping:
                    self._share_stop()
                    self._cancel_everything(generator)
                    return
                cancelled, self._cancelled = self._cancelled, set()
                transition = self._sleep_due(busy=bool(self._pending or self._running))
            self._drop_cancelled(generator, cancelled)
            if transition == "sleep":
                # The last jobs go too: a finished one still holds its draft lane.
                generator, admitted = None, []
                self._fall_asleep()
                continue
            if transition == "wake":
                generator = self._wake_up()
                if generator is None:  # the reload failed: still asleep
                    continue
            with self._cond:
                admitted = self._admissions()
            if self._lane is not None and not self._lead(admitted, cancelled):
                return  # the group is broken: every request has failed
            generator = self._advance(generator, admitted)
            if generator is None:
                return

    def _admissions(self) -> list[RunningSequence]:
        """Under the lock: queued jobs, in priority order, into free slots. A job pinned to
        a slot (`id_slot`) waits until that slot is free; the others take the lowest free
        slot no waiting pinned job asks for, else the lowest."""
        admitted: list[RunningSequence] = []
        waiting: list[tuple[int, int, RunningSequence]] = []
        while self._pending and self._free_slots:
            entry = heapq.heappop(self._pending)
            job = entry[2]
            slot = job.request.id_slot
            if slot < 0:
                wanted = {p[2].request.id_slot for p in (*self._pending, *waiting)}
                slot = next((s for s in self._free_slots if s not in wanted), self._free_slots[0])
            elif slot not in self._free_slots:
                waiting.append(entry)
                continue
            self._occupy(job, slot)
            admitted.append(job)
        for entry in waiting:
            heapq.heappush(self._pending, entry)
        return admitted

    def _occupy(self, job: RunningSequence, slot: int) -> None:
        """Under the lock: `job` takes `slot` (free) and runs."""
        job.slot = slot
        self._free_slots.remove(slot)
        self._used_slots.add(slot)
        self._running[job.request.request_id] = job

    def _advance(self, generator: Any, admitted: list[RunningSequence]) -> Any:
        """One step: admit `admitted`, prefill, one batched forward; the generator to go on
        with (a fresh one after a failed step), or None when the group of ranks broke."""
        for job in admitted:
            self._admit_alone(generator, job)
        if self._lane is not None and admitted and not self._agree_admissions(generator, admitted):
            return None
        self._prefill_alone(generator)
        try:
            if self._spec is not None and self._spec.step(self._batch_side, generator):
                return generator
            if self._by_uid:
                if self._lane is None:
                    self._step(generator)
                else:
                    with self._lane.collective():
                        self._step(generator)
        except Exception as exc:  # keep the engine alive: fail what was running
            if self._lane is not None:
                # A step that failed on one rank may have left the ranks' collectives out
                # of step: a split model stops here rather than risk a wrong answer.
                if self._lane.failure is None:
                    log.exception("engine step failed")
                    rank = self._lane.ranks.rank
                    self._lane.broken(f"a step failed on rank {rank}: {_first_line(exc)}")
                return None
            log.exception("engine step failed")
            for job in list(self._running.values()):
                self._finish(job, "error", error=_first_line(exc))
            generator = self._new_generator()
        return generator

    # ------------------------------------------------------ distributed lane

    def _lead(self, admitted: list[RunningSequence], cancelled: set[str]) -> bool:
        """Rank 0: send this step's inputs to the other ranks; False when the group broke."""
        from mlxcel.engine.distributed.group import GroupBrokenError
        from mlxcel.engine.distributed.lane import StepInputs, follower_copy

        assert self._lane is not None
        inputs = StepInputs(
            admitted=[(follower_copy(j.request), j.slot, j.max_tokens) for j in admitted],
            cancelled=sorted(cancelled),
        )
        try:
            self._lane.share(inputs)
        except GroupBrokenError:
            return False
        return True

    def _share_stop(self) -> None:
        """Rank 0, stopping: the other ranks stop too."""
        if self._lane is None or self._lane.failure is not None:
            return
        from mlxcel.engine.distributed.group import GroupBrokenError
        from mlxcel.engine.distributed.lane import StepInputs

        with contextlib.suppress(GroupBrokenError):
            self._lane.share(StepInputs(stop=True))

    def follow(self) -> str | None:
        """A follower rank: run rank 0's steps until it stops; the group's failure, if it
        broke (None: rank 0 stopped)."""
        assert self._lane is not None and not self._lane.leader
        self.start()
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=1.0)
        return self._lane.failure

    def _follow(self) -> None:
        """Engine thread of a follower rank: rank 0's admissions and cancellations, the
        same steps."""
        from mlxcel.engine.distributed.group import GroupBrokenError

        lane = self._lane
        assert lane is not None
        generator = self._new_generator()
        while True:
            self._pipeline.flush_sinks()
            try:
                inputs = lane.share()
            except GroupBrokenError:
                return
            except Exception as exc:  # bytes that are no step: the ranks are out of step
                lane.broken(f"rank 0's step could not be read ({_first_line(exc)})")
                return
            if inputs.stop:
                self._cancel_everything(generator)
                return
            try:
                admitted = self._follow_inputs(generator, inputs)
            except Exception as exc:  # a slot busy here, say: the ranks are out of step
                lane.broken(f"rank 0's step could not be applied ({_first_line(exc)})")
                return
            generator = self._advance(generator, admitted)
            if generator is None:
                return

    def _follow_inputs(self, generator: Any, inputs: StepInputs) -> list[RunningSequence]:
        """A follower: rank 0's cancellations, and its admissions into the same slots."""
        self._drop_cancelled(generator, set(inputs.cancelled))
        admitted = []
        with self._cond:
            for request, slot, budget in inputs.admitted:
                if slot not in self._free_slots or request.request_id in self._jobs:
                    raise InvalidRequestError(
                        f"slot {slot} or request {request.request_id} is busy on this rank"
                    )
                job = RunningSequence(request=request, sink=_discard, max_tokens=budget)
                self._jobs[request.request_id] = job
                self._occupy(job, slot)
                admitted.append(job)
        return admitted

    def _agree_admissions(self, generator: Any, admitted: list[RunningSequence]) -> bool:
        """Every rank runs the sequences every rank admitted: one whose admission failed on
        some rank (rank 0 alone builds its grammar and thinking budget) leaves the batch on
        all of them. False when the group broke."""
        from mlxcel.engine.distributed.group import GroupBrokenError

        assert self._lane is not None
        mine = [int(job.uid in self._by_uid) for job in admitted]
        try:
            agreed = self._lane.agree_min(mine)
        except GroupBrokenError:
            return False
        for job, here, everywhere in zip(admitted, mine, agreed, strict=True):
            if here and not everywhere:
                generator.remove([job.uid])
                self._finish(job, "error", error="the request could not be admitted on every rank")
        return True

    def _group_broken(self, reason: str) -> None:
        """The group of ranks broke (any thread): every queued and running request fails;
        new ones are refused from now on (`_queue`)."""
        with self._cond:
            jobs = [job for _, _, job in self._pending] + list(self._running.values())
            self._pending.clear()
            self._cond.notify_all()
        for job in jobs:
            self._finish(job, "error", error=reason)
        self._pipeline.flush_sinks()

    def _agreed_prefix(
        self, tokens: list[int], cache: list[Any] | None, n: int, slot: int | None
    ) -> tuple[list[Any] | None, int]:
        """The longest cached prefix of `tokens` that every rank's prompt cache holds (each
        rank caches its own shard of the KV), from this rank's `(cache, n)` (looked up for
        `slot`, as again here)."""
        assert self._lane is not None
        while True:
            low, high = self._lane.agree_prefix(n)
            if low == high:
                return cache, n
            if low == 0:
                cache, n = None, 0
            else:
                cache, n = self._lookup(tokens[: low + 1], slot)

    def _lookup(self, tokens: Sequence[int], slot: int | None) -> tuple[list[Any] | None, int]:
        """The prompt cache's longest prefix of `tokens`; in a group of ranks a lookup that
        fails holds nothing (the ranks' agreement on the prefix must still happen)."""
        try:
            return self.prompt_cache.lookup(tokens, slot=slot)
        except Exception:
            if self._lane is None:
                raise
            log.exception("prompt cache lookup failed; starting without a cached prefix")
            return None, 0

    def _fall_asleep(self) -> None:
        """Engine thread: free the model, its caches and the prompt cache."""
        assert self._sleep is not None
        before = self._before_unload()
        self._spec = None
        self._batch_sampler = self._rows = None
        freed = self.prompt_cache.release() if self.prompt_cache is not None else None
        self.loaded = replace(self.loaded, model=None)
        release_memory()
        cached = f"; {freed.freed_entries} prompt-cache entries dropped" if freed else ""
        report_sleep(log, self._sleep.seconds, before, cached)

    def _wake_up(self) -> Any:
        """Engine thread: load the model again; a fresh generator, or None on failure
        (the waiting requests then fail, and the engine stays asleep)."""
        assert self._sleep is not None
        started = time.perf_counter()
        try:
            reloaded = self._sleep.reload()
            self.loaded = replace(self.loaded, model=reloaded.model)
            if reloaded.speculation is not None:
                self._spec = self._speculative_lane(reloaded.speculation)
            generator = self._new_generator()
        except Exception as exc:  # noqa: BLE001 - the server stays up, asleep
            log.exception("reloading the model after sleeping failed")
            self.loaded = replace(self.loaded, model=None)
            error = reload_error(exc)
            with self._cond:
                jobs = [job for _, _, job in self._pending]
                self._pending.clear()
                waiters = self._sleep.woke(error)
            for job in jobs:
                self._finish(job, "error", error=str(error))
            resolve(waiters, error)
            return None
        with self._cond:
            waiters = self._sleep.woke()
        resolve(waiters)
        report_wake(log, started)
        return generator

    def _new_generator(self) -> Any:
        from mlx_lm.generate import StopSequences

        from mlxcel.engine.text.decode_batch import DecodeBatch

        eos = sorted(self.tokenizer.eos_token_ids)
        self._eos_stops = StopSequences([[t] for t in eos] if eos else None)
        self._no_stops = StopSequences(None)
        self._batch_sampler = self._rows = None
        if self.batched_sampling:
            from mlxcel.engine.sampling.batched import BatchSampler
            from mlxcel.engine.text.batch_rows import BatchRows

            self._batch_sampler = BatchSampler()
            self._rows = BatchRows(self._batch_sampler)
        self._step_sampler = self._batch_sampler
        if self._lane is not None and self._batch_sampler is not None:
            self._step_sampler = self._lane.shared_sampler(self._batch_sampler)
        model, before_forward = self._step_model()
        return DecodeBatch(
            model,
            completion_batch_size=self.n_slots,
            prefill_batch_size=self.n_slots,
            prefill_step_size=self.prefill_chunk,
            before_sampling=self._rows.before_sampling if self._rows is not None else None,
            before_forward=before_forward,
            kv_type=self.kv_type,
        )

    def _speculative_lane(self, speculation: SpeculationConfig) -> SpeculativeLane:
        from mlxcel.engine.text.speculative.engine_lane import SpeculativeLane
        from mlxcel.engine.text.speculative.lane import Speculator

        if not isinstance(self.loaded, LoadedModel):
            raise ValueError("speculative decoding needs a text model")
        return SpeculativeLane(
            Speculator(speculation, self.loaded, prefill_chunk=self.prefill_chunk)
        )

    def _step_model(self) -> tuple[Any, Callable[[list[int]], None] | None]:
        """The model the batched step runs, and what it is told of each forward's rows."""
        return self.loaded.model, None

    def _start_cache(self, job: RunningSequence) -> list[Any] | None:
        """The KV cache the sequence starts from (`job.start_n` prompt tokens in it, of
        which `job.cache_n` came from the prompt cache), or None for an empty one. A core
        may instead set `job.prefilling_alone`: the cache then comes a piece per step from
        `_grow_start_cache`."""
        if not self._caching(job):
            return None
        pinned = job.slot if job.request.id_slot >= 0 else None  # starts from its slot's KV
        cache, job.cache_n = self._lookup(job.request.prompt_tokens, pinned)
        if self._lane is not None:
            tokens = list(job.request.prompt_tokens)
            cache, job.cache_n = self._agreed_prefix(tokens, cache, job.cache_n, pinned)
        job.start_n = job.cache_n
        return cache

    def _inserted(self, job: RunningSequence) -> None:
        """`job` is in the generator now, as row `job.uid`."""

    def _cache_key(self, job: RunningSequence, tokens: list[int]) -> list[int]:
        """The prompt-cache key of a KV cache holding `tokens` of `job`'s sequence."""
        return tokens

    def _admit_alone(self, generator: Any, job: RunningSequence) -> None:
        """Admit `job`; if that fails, it fails alone (out of the generator, an error
        event) and the running batch goes on."""
        try:
            self._admit(generator, job)
        except Exception as exc:
            log.exception("admitting request %s failed", job.request.request_id)
            if job.uid >= 0:
                generator.remove([job.uid])
            self._finish(job, "error", error=_first_line(exc))

    def _admit(self, generator: Any, job: RunningSequence) -> None:
        from mlxcel.engine.sampling.chain import make_sampling

        request = job.request
        job.admitted = time.perf_counter()
        cache = self._start_cache(job)
        self._pipeline.admit(job)
        if job.max_tokens == 0:
            self._finish(job, "length")
            return
        sampler, processors = make_sampling(request.sampling, self.tokenizer.vocab_size)
        if request.grammar is not None:
            from mlxcel.engine.grammar import grammar_processor

            processors = [*processors, grammar_processor(request.grammar)]
        if request.thinking is not None:
            processors = [*processors, request.thinking.processor(self.tokenizer)]
        job.sampler = self._lane.shared_sampler(sampler) if self._lane is not None else sampler
        if self._spec is not None:
            self._spec.admit(job, processors)
        if self._rows is not None:
            from mlxcel.engine.sampling.batched import RowSampling

            # A logit bias that is the request's only processor is applied by the batch
            # sampler (no per-row processor loop), unless log-probabilities are reported:
            # they would then come before the bias.
            fold = bool(request.sampling.logit_bias) and len(processors) == 1
            fold = fold and request.logprobs is None
            job.row = RowSampling(
                request.sampling,
                self.tokenizer.vocab_size,
                logit_bias=fold,
                post_probs=request.logprobs if request.post_sampling_probs else None,
            )
            if fold:
                processors = []
        job.processors = processors
        if request.progress:
            self._pipeline.progress(job, 0)
        if job.prefilling_alone:  # its starting cache is built a piece per step first
            self._alone.append(job)
        else:
            self._insert(generator, job, cache)
        job.started = True  # a failure before this point fails a request never started
        self.counters.sequences_started += 1
        self.counters.busy_slots_max = max(self.counters.busy_slots_max, len(self._running))

    def _insert(self, generator: Any, job: RunningSequence, cache: list[Any] | None) -> None:
        """Put `job` into the generator, starting from `cache` (`job.start_n` tokens)."""
        request = job.request
        prompt = request.prompt_tokens
        (uid,) = generator.insert(
            [prompt[job.start_n :]],
            max_tokens=[job.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(prompt[: job.start_n])],
            samplers=[self._step_sampler if job.row is not None else job.sampler],
            logits_processors=[job.processors],
            stop_sequences=[self._no_stops if request.ignore_eos else self._eos_stops],
        )
        job.uid = uid
        self._by_uid[uid] = job
        self._inserted(job)
        if job.row is not None:
            self._rows.insert(uid, job.row)

    def _prefill_alone(self, generator: Any) -> None:
        """One piece of each alone-prefilling sequence's starting cache (between two batch
        steps, so the batch goes on meanwhile, as the generator feeds each prompt one chunk a
        step); a sequence joins the generator once its cache is complete. A failure fails
        that sequence alone."""
        for job in list(self._alone):
            try:
                cache = self._grow_start_cache(job)
                if cache is None:
                    continue
                self._alone.remove(job)
                job.prefilling_alone = False
                self._insert(generator, job, cache)
            except Exception as exc:
                log.exception("prefilling request %s failed", job.request.request_id)
                if job.uid >= 0:
                    generator.remove([job.uid])
                self._finish(job, "error", error=_first_line(exc))

    def _grow_start_cache(self, job: RunningSequence) -> list[Any] | None:
        """One piece of the starting cache of a sequence that prefills alone: the complete
        cache once it holds all prompt tokens but the last, else None."""
        raise NotImplementedError("only a core whose _start_cache prefills alone has this")

    def _step(self, generator: Any) -> None:
        with generator.stats() as stats:
            prompt_responses, responses = generator.next()
        if self._rows is not None:
            self._rows.after_step(responses)
        now = time.perf_counter()
        for p in prompt_responses:
            job = self._by_uid.get(p.uid)
            if job is None:
                continue
            if p.end_of_prompt:
                job.prefilled = True
            job.prefill_done = max(job.prefill_done, int(p.progress[0]))
            if job.request.progress and not job.finished:
                done, todo = (int(x) for x in p.progress)
                # All but the last token processed is the prompt done: the generator takes
                # that one into the first decode step (one report per chunk, as llama-server).
                self._pipeline.progress(job, done, p.end_of_prompt or done >= todo - 1)
        self._count_step(stats, len(responses), bool(prompt_responses))
        if self.kv_pool is not None and self._pool_exhausted(generator, responses):
            return
        for r in responses:
            job = self._by_uid.get(r.uid)
            if job is None or job.finished:
                continue
            self._on_token(generator, job, r, now)

    def _pool_exhausted(self, generator: Any, responses: list[Any]) -> bool:
        """Whether the step just taken overran the shared KV pool; if so, every running
        sequence fails (its tokens from this step unsent) and leaves the generator."""
        assert self.kv_pool is not None
        fed = {r.uid for r in responses}
        held = sum(
            job.kv_tokens(job.n_generated + (job.uid in fed))
            for job in self._running.values()
            if not job.finished
        )
        if held <= self.kv_pool:
            return False
        message = (
            f"context size has been exceeded: the {len(self._running)} running requests "
            f"need {held} tokens of the {self.kv_pool} the slots share (--kv-unified)"
        )
        log.warning("%s; failing them all", message)
        jobs = [job for job in self._running.values() if not job.finished]
        generator.remove([job.uid for job in jobs if job.uid in self._by_uid])
        for job in jobs:
            self._finish(job, "error", error=message)
        return True

    def _count_step(self, stats: Any, n_decoded: int, prefilled: bool) -> None:
        """Fold what the generator counted over one `next()` (its `BatchStats`) into ours."""
        c = self.counters
        c.prefill_tokens_total += stats.prompt_tokens
        c.prompt_seconds_total += stats.prompt_time
        c.decode_seconds_total += stats.decode_time
        c.decode_steps += stats.generation_steps
        c.prefill_chunks += int(prefilled)
        c.busy_slots_per_decode_total += n_decoded

    def _on_token(self, generator: Any, job: RunningSequence, r: Any, now: float) -> None:
        """One token of `job` from the batch or the speculative lane, through the pipeline;
        the sequence leaves the batch when it ends there."""
        self.counters.decode_tokens_total += 1
        if job.spec is not None:
            job.spec.history.append(int(r.token))
        if r.finish_reason is not None:  # the generator dropped it: keep its KV for reuse
            self._store_prompt_cache(job, r.all_tokens, r.prompt_cache)
        ending = self._pipeline.token(job, int(r.token), r.finish_reason, r.logprobs, now)
        if ending is None:
            return
        if ending.in_generator:
            self._remove(generator, job)
        self._finish(job, ending.reason, tail=ending.tail, stop_word=ending.stop_word)

    def _caching(self, job: RunningSequence) -> bool:
        return self.prompt_cache is not None and job.request.cache_prompt

    def _remove(self, generator: Any, job: RunningSequence) -> None:
        """Take `job` out of the generator, keeping its KV cache when caching applies."""
        held = self._spec.release(job) if self._spec is not None else None
        if held is not None:  # the speculative lane ran it: its KV cache is the lane's
            self._store_prompt_cache(job, held[1], held[0])
            return
        if self._rows is not None:
            self._rows.remove(job.uid)
        if not self._caching(job):
            generator.remove([job.uid])
            return
        caches = generator.remove([job.uid], return_prompt_caches=True)
        if job.uid in caches:
            cache, tokens = caches[job.uid]
            self._store_prompt_cache(job, tokens, cache)

    def _store_prompt_cache(self, job: RunningSequence, tokens: Any, cache: Any) -> None:
        """Offer a finished sequence's KV cache (holding exactly `tokens`) to the cache."""
        if not self._caching(job) or not tokens or not cache:
            return
        try:
            key = self._cache_key(job, list(tokens))
            self.prompt_cache.insert(key, list(cache), slot=job.slot)
        except Exception:  # a cache failure must never fail the request
            log.exception("prompt cache insert failed")

    def _finish(
        self,
        job: RunningSequence,
        reason: FinishReason,
        *,
        tail: str = "",
        error: str | None = None,
        stop_word: str | None = None,
    ) -> None:
        if job.finished:
            return
        job.finished = True
        if self._spec is not None:
            self._spec.forget(job)
        if job.prefilling_alone:
            self._alone.remove(job)
        end = time.perf_counter()
        if self._rows is not None and job.uid >= 0:
            self._rows.remove(job.uid)
        with self._cond:
            self._by_uid.pop(job.uid, None)
            if self._running.pop(job.request.request_id, None) is not None:
                self._free_slots.append(job.slot)
                self._free_slots.sort()
            self._jobs.pop(job.request.request_id, None)
            if self._sleep is not None:
                self._sleep.touch()
            count_finish(self.counters, job, reason, end)
        self._pipeline.finish(job, reason, end, tail=tail, error=error, stop_word=stop_word)

    def _drop_cancelled(self, generator: Any, cancelled: set[str]) -> None:
        if not cancelled:
            return
        for request_id in cancelled:
            job = self._jobs.get(request_id)
            if job is None or job.finished:
                continue
            if job.uid >= 0:
                self._remove(generator, job)
            with self._cond:
                self._pending = [p for p in self._pending if p[2] is not job]
                heapq.heapify(self._pending)
            self._finish(job, "cancelled")

    def _cancel_everything(self, generator: Any) -> None:
        jobs = [job for _, _, job in self._pending] + list(self._running.values())
        self._pending.clear()
        for job in jobs:
            self._finish(job, "cancelled")


def _discard(event: GenerationEvent) -> None:
    """A follower rank's sink: rank 0 answers the clients."""


class _BatchSide:
    """The core's batch as its speculative lane sees it (`engine_lane.BatchSide`)."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine

    @property
    def counters(self) -> EngineCounters:
        return self.engine.counters

    def n_running(self) -> int:
        return len(self.engine._running)

    def lone_sequence(self) -> RunningSequence | None:
        engine = self.engine
        if len(engine._running) != 1 or len(engine._by_uid) != 1:
            return None
        (job,) = engine._by_uid.values()
        return job

    def leave_batch(self, job: RunningSequence) -> tuple[Any, Any] | None:
        engine = self.engine
        del engine._by_uid[job.uid]
        if engine._rows is None:
            return None
        pending: tuple[Any, Any] | None = engine._rows.last_choice(job.uid)
        engine._rows.remove(job.uid)
        return pending

    def rejoin_batch(self, generator: Any, job: RunningSequence, lane: SoloLane) -> None:
        engine = self.engine
        job.uid = lane.hand_back(
            generator,
            n_generated=job.n_generated,
            max_tokens=job.max_tokens - job.n_generated,
            sampler=engine._batch_sampler if job.row is not None else job.sampler,
            stop_sequences=engine._no_stops if job.request.ignore_eos else engine._eos_stops,
        )
        engine._by_uid[job.uid] = job
        if job.row is not None:
            engine._rows.insert(job.uid, job.row)

    def eos_of(self, job: RunningSequence) -> frozenset[int] | tuple[()]:
        return () if job.request.ignore_eos else self.engine.tokenizer.eos_token_ids

    def deliver(self, generator: Any, job: RunningSequence, token: LaneToken, now: float) -> None:
        self.engine._on_token(generator, job, token, now)
