"""Prompt (prefix) cache: TTFT of a request sharing a ~1,000-token prefix with the previous one
vs the same request cold, against a real `mlxcel serve`.

Each repetition resets the cache (`POST /v1/cache/reset`), sends request A (the long shared
system prompt + question A: cold), then request B (the same system prompt + question B: its
prefix is cached), and then B again after a reset (cold B, the reference for B's TTFT). TTFT
is measured at the client, from sending to the first streamed content. Target: warm TTFT
<= 0.15x cold.

    .venv/bin/python bench/prompt_cache.py [-m MODEL] [-t PREFIX_TOKENS] [-r REPS]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    StreamResult,
    bench_model,
    load_note,
    median,
    mlxcel_server,
    spread,
    stream_chat,
)

TARGET = 0.15
_SENTENCES = (
    "The morning train left the station at 7:45, and the platform slowly emptied.",
    "A small dog waited by the bench; it didn't move until its owner came back.",
    "The river runs north for 350 miles before it reaches the sea near the old harbour.",
    "Good software is tested, measured, and explained; bad software is only hoped for.",
    "Water boils at 100 degrees and freezes at 0 degrees on the Celsius scale.",
    "The children played in the garden while their parents talked about the weather.",
)


def _prefix(url: str, tokens: int) -> tuple[str, int]:
    """A system prompt of at least `tokens` tokens (counted by the server's `/tokenize`)."""
    parts: list[str] = []
    count = 0
    i = 0
    while count < tokens:
        parts.extend(f"{n + i}. {s}" for n, s in enumerate(_SENTENCES))
        i += len(_SENTENCES)
        text = " ".join(parts)
        reply = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=30)
        reply.raise_for_status()
        count = len(reply.json()["tokens"])
    return text, count


def _body(system: str, question: str) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
        "temperature": 0,
    }


async def _one(url: str, body: dict[str, Any]) -> StreamResult:
    async with httpx.AsyncClient(timeout=300) as client:
        return await stream_chat(client, url, body)


def _reset(url: str) -> None:
    httpx.post(f"{url}/v1/cache/reset", timeout=30).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="model (default: 20M fp32 llama)")
    parser.add_argument("-t", "--prefix-tokens", type=int, default=1000)
    parser.add_argument("-r", "--reps", type=int, default=5)
    args = parser.parse_args()

    model = args.model or str(bench_model())
    server = mlxcel_server(model, "-np", "1", "-c", "4096", "--cache-prompt")
    cold: list[float] = []
    warm: list[float] = []
    cold_b: list[float] = []
    with server:
        system, n_prefix = _prefix(server.url, args.prefix_tokens)
        print(f"model: {model}  shared prefix: {n_prefix} tokens")
        question_a, question_b = "What time did the train leave?", "How long is the river?"
        asyncio.run(_one(server.url, _body("Warm-up.", "Hello")))
        for rep in range(args.reps):
            _reset(server.url)
            a = asyncio.run(_one(server.url, _body(system, question_a)))
            b = asyncio.run(_one(server.url, _body(system, question_b)))
            stats = httpx.get(f"{server.url}/v1/cache/stats", timeout=30).json()
            _reset(server.url)
            b_cold = asyncio.run(_one(server.url, _body(system, question_b)))
            cold.append(a.ttft)
            warm.append(b.ttft)
            cold_b.append(b_cold.ttft)
            print(
                f"rep {rep + 1}: cold A {a.ttft * 1000:7.1f} ms  warm B {b.ttft * 1000:7.1f} ms  "
                f"cold B {b_cold.ttft * 1000:7.1f} ms  (cache: {_stats_note(stats)}; "
                f"{load_note()})",
                flush=True,
            )
    ratio = median(warm) / median(cold_b)
    print()
    print(f"TTFT cold A (median): {median(cold) * 1000:8.1f} ms  range {_ms(cold)}")
    print(f"TTFT cold B (median): {median(cold_b) * 1000:8.1f} ms  range {_ms(cold_b)}")
    print(f"TTFT warm B (median): {median(warm) * 1000:8.1f} ms  range {_ms(warm)}")
    print(f"warm / cold TTFT = {ratio:.3f}x (target <= {TARGET}x)")


def _ms(values: list[float]) -> str:
    return spread([v * 1000 for v in values]) + " ms"


def _stats_note(stats: dict[str, Any]) -> str:
    keys = ("lookups", "hits", "entries")
    found = {k: stats[k] for k in keys if k in stats}
    return ", ".join(f"{k} {v}" for k, v in found.items()) or "stats " + str(stats)[:80]


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
