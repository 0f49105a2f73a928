"""Sleeping on idle (`--sleep-idle-seconds`): an engine (`TextEngine`, `VisionEngine`) frees
its model after a quiet spell and loads it again for the next request that needs it.

`IdleSleep` is the state the engine keeps under its lock: when the last request finished,
whether the engine sleeps, and who waits for it to wake. The engine thread does both
transitions itself, so MLX work stays on the thread that owns the model:

- asleep: no request queued or running for `seconds` since the last one finished (a
  streaming request holds its slot, so it is never idle); the engine drops the network,
  its batch generator (the KV caches), the draft model and the prompt cache, then asks MLX
  to return its buffer cache; the tokenizer (a vision model's processor) and the model's
  facts stay, they are small and `/props` reports them while asleep;
- awake: a request is queued, or someone called `TextEngine.wake()`; the engine runs
  `reload` (supplied by whoever built it: the server reloads from its settings) before
  it admits anything, so every request that arrived meanwhile waits for that one reload.

One line is logged on each transition, with the process's resident memory and MLX's
active memory before and after (`memory_now`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcel.engine.process_memory import MemoryUse, memory_now
from mlxcel.engine.text.speculative import SpeculationConfig

if TYPE_CHECKING:
    from mlxcel.engine.text.memory_budget import AdmissionControl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reloaded:
    """What waking up loads again: the network and, with speculation, its config."""

    model: Any  # an mlx-lm style nn.Module
    speculation: SpeculationConfig | None = None


Reloader = Callable[[], Reloaded]


class IdleSleep:
    """The sleep state of one engine. Every method runs under the engine's lock."""

    def __init__(
        self, seconds: float, reload: Reloader, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if seconds <= 0:
            raise ValueError("sleep_idle_seconds must be positive")
        self.seconds = float(seconds)
        self.reload = reload
        self._clock = clock
        self.asleep = False
        self.wake_asked = False
        self.last_active = clock()
        self._waiters: list[Future[None]] = []

    def touch(self) -> None:
        """A request arrived or finished: the idle clock starts again."""
        self.last_active = self._clock()

    def seconds_left(self) -> float:
        """Seconds until the engine may sleep (<= 0: it may sleep now)."""
        return self.last_active + self.seconds - self._clock()

    def ask_wake(self) -> Future[None]:
        """A future resolved once the engine is awake (at once when it already is)."""
        future: Future[None] = Future()
        if not self.asleep:
            future.set_result(None)
            return future
        self.wake_asked = True
        self._waiters.append(future)
        return future

    def wait_timeout(self) -> float | None:
        """With nothing to run: how long the engine may wait (None: until notified; <= 0:
        not at all, a transition is due)."""
        if self.asleep:
            return 0.0 if self.wake_asked else None
        return self.seconds_left()

    def transition(self, *, busy: bool) -> str | None:
        """What is due: `sleep` (now asleep) after an idle spell, `wake` when a sleeping
        engine has work (`busy`: a request queued or running) or was asked to wake, or None."""
        if self.asleep:
            return "wake" if busy or self.wake_asked else None
        if not busy and self.seconds_left() <= 0:
            self.asleep = True
            self.wake_asked = False
            return "sleep"
        return None

    def woke(self, error: BaseException | None = None) -> list[Future[None]]:
        """Leave sleep (or, with `error`, stay asleep); the waiters to resolve, outside the lock."""
        waiters, self._waiters = self._waiters, []
        self.wake_asked = False
        if error is None:
            self.asleep = False
            self.touch()
        return waiters


class Sleeps:
    """`sleeping` and `wake()` for an engine with `_sleep` (IdleSleep | None), its lock
    `_cond`, its memory admission `memory` and `start()`."""

    _sleep: IdleSleep | None
    _cond: threading.Condition
    memory: AdmissionControl

    def start(self) -> Any:
        raise NotImplementedError

    @property
    def sleeping(self) -> bool:
        """Whether the model is unloaded after an idle spell."""
        return self._sleep is not None and self._sleep.asleep

    def wake(self) -> Future[None]:
        """Ask a sleeping engine to load its model again; the future resolves once it has
        (at once when awake), or fails with the reload's error."""
        if self._sleep is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        with self._cond:
            future = self._sleep.ask_wake()
            self._cond.notify_all()
        self.start()
        return future

    def _idle_wait(self) -> bool:
        """Under the lock, with nothing to run: wait for a notification or until a sleep
        is due; False at once when a transition is due."""
        timeout = self._sleep.wait_timeout() if self._sleep is not None else None
        if timeout is not None and timeout <= 0:
            return False
        self._cond.wait(timeout)
        return True

    def _sleep_due(self, *, busy: bool) -> str | None:
        """Under the lock: the transition due (IdleSleep.transition), None without sleep."""
        return self._sleep.transition(busy=busy) if self._sleep is not None else None

    def _before_unload(self) -> MemoryUse:
        """Engine thread, about to drop the network: keep the memory admission's shapes
        (estimated from the network) and note the memory in use."""
        before = memory_now()
        try:
            self.memory.admission()
        except Exception:  # noqa: BLE001 - then it is estimated again after the wake-up
            log.exception("memory admission before sleeping failed")
        return before

    def _end_sleep(self) -> None:
        """At stop: whoever waits for a wake-up hears that none will come."""
        if self._sleep is None:
            return
        error = RuntimeError("the engine is shutting down")
        with self._cond:
            waiters = self._sleep.woke(error)
        resolve(waiters, error)


def report_sleep(log: logging.Logger, seconds: float, before: MemoryUse, extra: str = "") -> None:
    """The one line logged when an engine fell asleep (memory before and now)."""
    log.warning(
        "mlxcel: sleeping after %g s idle: model unloaded (%s -> %s)%s",
        seconds,
        before.mib(),
        memory_now().mib(),
        extra,
    )


def report_wake(log: logging.Logger, started: float) -> None:
    """The one line logged when an engine woke (`started`: time.perf_counter() before)."""
    log.warning(
        "mlxcel: awake: model reloaded in %.2f s (%s)",
        time.perf_counter() - started,
        memory_now().mib(),
    )


def reload_error(exc: BaseException) -> RuntimeError:
    """What the requests that waited for a failed reload are told."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RuntimeError(f"reloading the model failed: {text}")


def resolve(waiters: list[Future[None]], error: BaseException | None = None) -> None:
    """Tell everyone waiting for a wake-up how it went."""
    for future in waiters:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
