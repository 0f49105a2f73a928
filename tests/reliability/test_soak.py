"""Soak: 64 concurrent streaming clients on a tiny model with -np 8.

The CI form runs MLXCEL_SOAK_SECONDS (default 30 s); the 5-minute form is marked `soak`
(`pytest -m soak tests/reliability/test_soak.py -s` prints the figures docs/reliability.md
quotes). Zero lost or truncated streams, only 503 server_busy (with Retry-After) as
backpressure, RSS within 10 % of its post-warm-up value (the warm-up lasts until the
prompt cache is full), every slot idle at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from load import run_load
from server_harness import ServeProcess

CLIENTS = 64


def _soak(model_dir: Path, seconds: float, warmup: float, extra: list[str]) -> None:
    args = ["-m", str(model_dir), "-np", "8", "-c", "8192", "--max-queue-depth", "32", *extra]
    with ServeProcess(args) as server:
        assert server.proc is not None
        report = asyncio.run(
            run_load(server.url, server.proc.pid, seconds=seconds, clients=CLIENTS, warmup=warmup)
        )
        figures = report.figures()
        print(f"\nsoak {seconds:g}s x {CLIENTS} clients: {json.dumps(figures)}")
        assert report.unexpected == [], figures
        assert report.lost == 0, figures
        assert report.requests >= CLIENTS, figures
        assert report.rss_warm > 0, f"the prompt cache never filled: {figures}"
        assert report.rss_end <= report.rss_warm * 1.10, figures
        deadline = time.monotonic() + 10
        with server.client() as client:
            while time.monotonic() < deadline:
                slots = client.get("/slots").json()
                if all(not slot["is_processing"] for slot in slots):
                    break
                time.sleep(0.05)
            assert all(not slot["is_processing"] for slot in slots), slots
            assert client.get("/health").json()["status"] == "ok"
        assert "Traceback" not in server.stderr


def test_soak_ci_form(tiny_llama_dir: Path) -> None:
    # A 4 MiB prompt cache fills in seconds, so the steady state starts within the run.
    seconds = float(os.environ.get("MLXCEL_SOAK_SECONDS", "30"))
    _soak(tiny_llama_dir, seconds, warmup=seconds / 3, extra=["--cache-ram", "4"])


@pytest.mark.soak
def test_soak_five_minutes(tiny_llama_dir: Path) -> None:
    # The default prompt cache holds 1024 entries: warm once it has filled (about a minute
    # of this load on 2 free cores); RSS grows with the cache until then, by design.
    _soak(tiny_llama_dir, 300.0, warmup=30.0, extra=[])
