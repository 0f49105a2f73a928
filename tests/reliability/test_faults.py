"""Faults: SIGTERM during generation drains the server; it never drops a running request."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from server_harness import ServeProcess
from sse_reader import sse_data

N_PREDICT = 400


def _stream_completion(
    url: str, results: list[dict[str, object]], started: threading.Event
) -> None:
    body = {
        "prompt": "Once upon a time",
        "n_predict": N_PREDICT,
        "ignore_eos": True,
        "stream": True,
    }
    tokens = 0
    final: dict[str, object] = {}
    try:
        with httpx.stream("POST", f"{url}/completion", json=body, timeout=120) as response:
            for line in response.iter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                try:
                    event = json.loads(data)
                except ValueError:  # a line split inside an event: recorded, and the test fails
                    results.append({"status": None, "bad_line": line, "chunks": tokens})
                    started.set()
                    return
                tokens += 1
                started.set()
                if event.get("stop"):
                    final = event
        results.append({"status": response.status_code, "chunks": tokens, "final": final})
    except httpx.HTTPError as exc:
        results.append({"status": None, "error": type(exc).__name__, "chunks": tokens})
        started.set()


def test_sigterm_drains_in_flight_requests(tiny_llama_dir: Path) -> None:
    server = ServeProcess(["-m", str(tiny_llama_dir), "-np", "2", "-c", "4096", "--no-warmup"])
    server.start()
    try:
        results: list[dict[str, object]] = []
        started = threading.Event()
        threads = [
            threading.Thread(target=_stream_completion, args=(server.url, results, started))
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        assert started.wait(60), server.stderr
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        health: list[tuple[int, str]] = []
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            try:
                answer = httpx.get(f"{server.url}/health", timeout=2)
                health.append((answer.status_code, answer.json().get("status", "")))
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        for thread in threads:
            thread.join(10)
        code = server.wait_exit(30)
    finally:
        server.stop()
    assert code == 0, server.stderr
    assert "draining" in server.stderr
    assert (503, "draining") in health, health
    assert len(results) == 2, results
    for result in results:  # every in-flight request ran to its end
        assert result["status"] == 200, result
        final = result["final"]
        assert isinstance(final, dict) and final.get("stop") is True, result
        assert final.get("tokens_predicted") == N_PREDICT, final
    assert "Traceback" not in server.stderr
