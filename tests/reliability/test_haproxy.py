"""deploy/haproxy.cfg in front of 3 real replicas: no request lost when one dies, sessions
stick to a replica, load spreads. Runs where haproxy is installed (always in CI)."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fixtures.haproxy import Cluster, haproxy_cluster, require_haproxy

require_haproxy()


class Replicas:
    """Three tiny-model replicas behind HAProxy, and one way to send them a completion."""

    def __init__(self, cluster: Cluster):
        self.replicas = cluster.replicas
        self.url = cluster.url

    def complete(self, n_predict: int = 24, session: str | None = None) -> tuple[int, str]:
        headers = {"X-Session-Id": session} if session else {}
        body = {"prompt": "The river runs", "n_predict": n_predict, "ignore_eos": True}
        response = httpx.post(f"{self.url}/completion", json=body, headers=headers, timeout=120)
        return response.status_code, response.headers.get("x-served-by", "")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "2048", "--no-warmup"]
    with haproxy_cluster(args, 3, tmp_path_factory.mktemp("haproxy")) as running:
        yield Replicas(running)


def test_sessions_stick_to_one_replica(cluster: Replicas) -> None:
    served: dict[str, set[str]] = {}
    for turn in range(3):
        for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
            status, server = cluster.complete(8, session=f"{session}-{turn // 3}")
            assert status == 200
            served.setdefault(session, set()).add(server)
    assert all(len(servers) == 1 for servers in served.values()), served
    assert len({next(iter(s)) for s in served.values()}) >= 2, served  # sessions hash apart


def test_load_spreads_over_the_replicas(cluster: Replicas) -> None:
    with ThreadPoolExecutor(9) as pool:
        results = list(pool.map(lambda _: cluster.complete(48), range(18)))
    assert all(status == 200 for status, _ in results), results
    counts = Counter(server for _, server in results)
    assert set(counts) == {"r1", "r2", "r3"}, counts


def test_a_replica_killed_mid_run_loses_no_request(cluster: Replicas) -> None:
    victim = cluster.replicas[0]
    assert victim.proc is not None
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(cluster.complete, 64) for _ in range(36)]
        while sum(f.done() for f in futures) < 6:
            time.sleep(0.05)
        victim.proc.send_signal(signal.SIGKILL)  # no drain: in-flight requests are cut
        results = [f.result() for f in futures]
    statuses = Counter(status for status, _ in results)
    assert statuses == {200: 36}, statuses
    after = Counter(server for _, server in results[12:])
    assert set(after) <= {"r1", "r2", "r3"}
    status, server = cluster.complete(8)
    assert status == 200 and server in {"r2", "r3"}
