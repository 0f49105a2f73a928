"""Greedy output does not depend on the prompt cache: cold, partial and full hits agree.

Through a real server on the embedded default (SmolLM2 Q4_1, mlxcel's CPU kernel): the same
temperature-0 request, after `/v1/cache/reset` (cold), right after itself (all but the last
prompt token cached) and after a request that shares only its system prompt (a partial hit),
continues with the same 48 tokens. It did not while the uncached remainder of a partial hit
(up to 16 rows) took the kernel's attention and a cold prefill MLX's (docs/cpu.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from server_harness import serve

SYSTEM = "You are a helpful assistant who answers questions about geography in detail."
QUESTION = "Write a short poem about mountains."  # diverged on a partial hit before the fix
OTHER = "What is the capital of Peru?"


def _ask(http: httpx.Client, question: str) -> tuple[str, int, int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body: dict[str, Any] = {"messages": messages, "temperature": 0, "max_tokens": 48}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    usage = answer["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


def test_cold_partial_and_full_hits_continue_alike(smollm2_gguf: Path) -> None:
    args = ["-m", str(smollm2_gguf), "-c", "2048", "--no-warmup"]
    with serve(args) as server, server.client() as http:
        assert http.post("/v1/cache/reset").status_code == 200
        cold, n_prompt, cold_cached = _ask(http, QUESTION)
        full, _, full_cached = _ask(http, QUESTION)
        assert http.post("/v1/cache/reset").status_code == 200
        _ask(http, OTHER)
        partial, _, partial_cached = _ask(http, QUESTION)
    assert (cold_cached, full_cached) == (0, n_prompt - 1)
    assert 16 <= partial_cached < n_prompt - 1  # the system prompt only: a partial hit
    assert len(cold.split()) >= 20  # a real continuation (48 tokens)
    assert full == cold
    assert partial == cold
