"""Disconnect storm: 100 streaming clients drop mid-stream. Every slot is free soon after
(the time is printed; docs/reliability.md quotes it), the prompt cache still answers
exactly as before, /health is ok and nothing was logged as a traceback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServeProcess
from sse_reader import aiter_sse_lines, sse_data

CLIENTS = 100
FREE_WITHIN_S = 1.0  # the bound issue 17 sets; the figure measured is printed


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    args = ["-m", str(tiny_llama_dir), "-np", "8", "-c", "8192", "--max-queue-depth", "128"]
    with ServeProcess(args) as running:
        yield running


PROMPT = (
    "The morning train left the station at 7:45, and the platform slowly emptied. "
    "A small dog waited by the bench; it did not move until its owner came back. "
    "The river runs north for 350 miles before it reaches the sea near the old harbour."
)  # longer than a few prompt-cache blocks (16 tokens each)
GREEDY = {"prompt": PROMPT, "n_predict": 24, "temperature": 0}


def _greedy(client: httpx.Client, **extra: Any) -> tuple[str, dict[str, Any]]:
    answer = client.post("/completion", json={**GREEDY, **extra}).json()
    return answer["content"], answer["timings"]


async def _drop_mid_stream(url: str, index: int, dropped: list[float]) -> None:
    body = {
        "messages": [{"role": "user", "content": f"Story number {index}: once upon a time"}],
        "max_tokens": 400,
        "stream": True,
    }
    async with (
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        chunks = 0
        async for line in aiter_sse_lines(response):
            if '"content"' in (sse_data(line) or ""):
                chunks += 1
                if chunks >= 2:  # really mid-stream: generated tokens came
                    break
    dropped.append(time.monotonic())


def _idle(client: httpx.Client) -> bool:
    slots = client.get("/slots").json()
    health = client.get("/health").json()
    queued = health.get("batch", {}).get("queue_depth", 0)
    return all(not slot["is_processing"] for slot in slots) and queued == 0


def test_a_disconnect_storm_frees_every_slot(server: ServeProcess) -> None:
    with server.client() as client:
        before, _ = _greedy(client)
        again, timings = _greedy(client)
        assert again == before and timings.get("cache_n", 0) > 0  # served from the cache

        async def storm() -> list[float]:
            dropped: list[float] = []
            await asyncio.gather(
                *(_drop_mid_stream(server.url, i, dropped) for i in range(CLIENTS))
            )
            return dropped

        dropped = asyncio.run(storm())
        last_drop = max(dropped)
        while not _idle(client) and time.monotonic() - last_drop < 30:
            time.sleep(0.02)
        freed_after = time.monotonic() - last_drop
        print(
            f"\ndisconnect storm: {CLIENTS} clients dropped; slots free {freed_after:.3f} s after"
        )
        assert len(dropped) == CLIENTS
        assert _idle(client)
        assert freed_after <= FREE_WITHIN_S

        after, timings = _greedy(client)
        assert after == before  # the prompt cache gives back exactly what it stored
        assert timings.get("cache_n", 0) > 0
        uncached, _ = _greedy(client, cache_prompt=False)
        assert uncached == before
        stats = client.get("/v1/cache/stats").json()
        assert stats["entries"] <= stats["max_entries"]
        assert 0 <= stats["bytes"] <= stats["capacity_bytes"]
        assert client.get("/health").json()["status"] == "ok"
        metrics = client.get("/slots").json()
        assert len(metrics) == 8
    assert "Traceback" not in server.stderr
