"""Bounded load on a running server: streaming clients, their figures, the server's RSS.

Used by the soak and disconnect tests (and runnable on its own: `python
tests/reliability/load.py URL PID SECONDS CLIENTS` prints the figures as JSON).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # run as a script: sse_reader is in tests/
    sys.path.insert(0, str(TESTS))
from sse_reader import DONE, aiter_sse_lines, sse_data  # noqa: E402

CHAT = "/v1/chat/completions"


@dataclass
class LoadReport:
    """What a load run saw."""

    requests: int = 0  # streams that ran to their end
    busy_503: int = 0  # 503 server_busy answers (with Retry-After), retried
    lost: int = 0  # streams that ended without a finish_reason and [DONE]
    unexpected: list[str] = field(default_factory=list)  # any other status or failure
    ttft_ms: list[float] = field(default_factory=list)
    rss_warm: int = 0  # RSS once warm (0: the prompt cache never filled in the run)
    warm_at_s: float = 0.0  # seconds into the run when it was warm
    rss_end: int = 0

    def figures(self) -> dict[str, Any]:
        """The summary the docs quote."""
        ttft = sorted(self.ttft_ms)

        def pct(p: float) -> float:
            return round(ttft[min(len(ttft) - 1, int(p * len(ttft)))], 1) if ttft else 0.0

        out = {k: v for k, v in asdict(self).items() if k not in ("ttft_ms", "unexpected")}
        out["unexpected"] = self.unexpected[:10]
        out["ttft_p50_ms"] = round(statistics.median(ttft), 1) if ttft else 0.0
        out["ttft_p99_ms"] = pct(0.99)
        out["rss_growth"] = round(self.rss_end / self.rss_warm - 1, 4) if self.rss_warm else 0.0
        return out


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def chat_body(rng: random.Random, stream: bool = True) -> dict[str, Any]:
    words = " ".join(rng.choice(("river", "train", "boxes", "Paris", "moon")) for _ in range(6))
    return {
        "messages": [{"role": "user", "content": f"Tell me about {words}"}],
        "max_tokens": rng.randint(8, 48),
        "temperature": 0.8,
        "stream": stream,
    }


async def one_stream(
    client: httpx.AsyncClient, body: dict[str, Any], report: LoadReport
) -> str | None:
    """Run one streamed chat request to its end; 'busy' on 503 server_busy, else None."""
    started = time.perf_counter()
    first = 0.0
    finish = None
    done = False
    async with client.stream("POST", CHAT, json=body) as response:
        if response.status_code == 503:
            payload = json.loads(await response.aread())
            kind = payload.get("error", {}).get("type")
            if kind == "server_busy" and response.headers.get("retry-after"):
                report.busy_503 += 1
                return "busy"
            report.unexpected.append(
                f"503 {kind} retry-after={response.headers.get('retry-after')}"
            )
            return None
        if response.status_code != 200:
            report.unexpected.append(f"{response.status_code} {(await response.aread())[:200]!r}")
            return None
        async for line in aiter_sse_lines(response):
            data = sse_data(line)
            if data is None:
                continue
            if data == DONE:
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                report.unexpected.append(f"stream error {chunk['error']}")
                return None
            choice = (chunk.get("choices") or [{}])[0]
            if not first and (choice.get("delta") or {}).get("content"):
                first = time.perf_counter()
            finish = choice.get("finish_reason") or finish
    if not done or finish is None:
        report.lost += 1
        return None
    report.requests += 1
    if first:
        report.ttft_ms.append((first - started) * 1000)
    return None


async def run_load(
    url: str, pid: int, *, seconds: float, clients: int, warmup: float, seed: int = 0
) -> LoadReport:
    """`clients` streaming clients for `seconds`; RSS once warm (at least `warmup` s in, and
    the prompt cache full) and at the end."""
    report = LoadReport()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients)
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                try:
                    if await one_stream(client, chat_body(rng), report) == "busy":
                        await asyncio.sleep(0.05 + rng.random() * 0.2)  # back off, retry
                except httpx.HTTPError as exc:
                    report.unexpected.append(f"transport {type(exc).__name__}")

        async def sample_rss() -> None:
            # Warm once `warmup` seconds have passed and the prompt cache is full (it has
            # evicted): until then RSS grows with the cache, by design.
            await asyncio.sleep(warmup)
            while time.monotonic() < deadline - 1:
                stats = (await client.get("/v1/cache/stats")).json()
                if not stats.get("enabled") or stats.get("evictions_lru", 0) > 0:
                    report.rss_warm = rss_bytes(pid)
                    report.warm_at_s = round(seconds - (deadline - time.monotonic()), 1)
                    return
                await asyncio.sleep(0.5)

        await asyncio.gather(sample_rss(), *(worker(i) for i in range(clients)))
    report.rss_end = rss_bytes(pid)
    return report


if __name__ == "__main__":
    target, process, span, count = (
        sys.argv[1],
        int(sys.argv[2]),
        float(sys.argv[3]),
        int(sys.argv[4]),
    )
    result = asyncio.run(run_load(target, process, seconds=span, clients=count, warmup=span / 5))
    print(json.dumps(result.figures(), indent=2))
