"""The one registry of running worker threads, stopped at interpreter exit at the latest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlxcel.engine.workers import live_workers
from mlxcel.engine.workers.batch_worker import BatchWorker

REPO = Path(__file__).resolve().parents[1]


class _Worker:
    def __init__(self) -> None:
        self.stopped_with: list[float | None] = []

    def stop(self, timeout: float | None = 5.0) -> None:
        self.stopped_with.append(timeout)
        live_workers.untrack(self)


def test_started_workers_are_tracked_until_stopped() -> None:
    worker = BatchWorker("tracked").start()
    try:
        assert worker in live_workers._LIVE
    finally:
        worker.stop()
    assert worker not in live_workers._LIVE


def test_exit_stops_what_is_still_running() -> None:
    running, stopped = _Worker(), _Worker()
    live_workers.track(running)
    live_workers.track(stopped)
    stopped.stop()
    live_workers.stop_live_workers()
    assert running.stopped_with == [live_workers.EXIT_TIMEOUT]
    assert stopped.stopped_with == [5.0]
    assert running not in live_workers._LIVE


def test_a_process_exits_with_a_worker_still_running() -> None:
    code = (
        "from mlxcel.engine.workers.batch_worker import BatchWorker\n"
        "worker = BatchWorker('left-running').start()\n"
        "stop = worker.stop\n"
        "def report(timeout=5.0):\n"
        "    stop(timeout)\n"
        "    print('stopped at exit', timeout, worker.running)\n"
        "worker.stop = report\n"
        "print(worker.running)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["True", "stopped at exit 10.0 False"]
