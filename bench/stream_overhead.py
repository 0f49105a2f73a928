"""One client's decode tok/s through `mlxcel serve` (HTTP + SSE) vs `mlx_lm.stream_generate`
in-process on the same model, prompt and settings, in one run.

Both sides decode the same chat-templated prompt greedily for the same number of tokens
(end-of-sequence tokens biased away on both), and both rates are measured the same way:
tokens after the first, over the time from the first token to the last one (as the client
sees them). Repetitions alternate between the two. This process imports `mlxcel.engine`
before MLX, so `stream_generate` runs on the same BLAS as the server. Target: >= 0.95x.

On a shared machine the wall-clock rates swing with the other load; the CPU time each side
spends per generated token (the server process's, all its threads; this process's for
`stream_generate`) swings less, and its ratio is printed too.

    .venv/bin/python bench/stream_overhead.py [-m MLX_DIR] [-n TOKENS] [-r REPS] [-np SLOTS]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import mlxcel.engine  # noqa: F401  (loads the system BLAS before MLX, as the server does)
from mlxcel.engine.blas import blas_in_use

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PROMPTS,
    bench_model,
    eos_bias,
    load_note,
    median,
    mlxcel_server,
    spread,
    stream_chat,
)

TARGET = 0.95


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _in_process(
    model: Any, tokenizer: Any, prompt: list[int], n: int, bias: dict
) -> tuple[float, float]:
    """Decode tok/s of `mlx_lm.stream_generate`, timed at each yielded token, and the
    tokens per CPU-second this process spent on the whole generation."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    processors = make_logits_processors(logit_bias={int(k): v for k, v in bias.items()})
    times: list[float] = []
    cpu = time.process_time()
    for _ in stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=n,
        sampler=make_sampler(temp=0.0),
        logits_processors=processors,
    ):
        times.append(time.perf_counter())
    cpu = time.process_time() - cpu
    return (len(times) - 1) / (times[-1] - times[0]), len(times) / cpu if cpu > 0 else 0.0


async def _over_http(url: str, body: dict[str, Any]) -> tuple[float, int]:
    async with httpx.AsyncClient(timeout=300) as client:
        result = await stream_chat(client, url, body)
    return result.decode_rate, result.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", type=Path, default=None, help="MLX dir (default: 20M)")
    parser.add_argument("-n", "--tokens", type=int, default=96)
    parser.add_argument("-r", "--reps", type=int, default=5)
    parser.add_argument("-np", "--parallel", type=int, default=1, help="server slots")
    args = parser.parse_args()

    from mlx_lm import load

    model_dir = args.model or bench_model()
    bias = eos_bias(model_dir)
    loaded = load(str(model_dir))
    model, tokenizer = loaded[0], loaded[1]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    body = {"messages": messages, "max_tokens": args.tokens, "temperature": 0, "logit_bias": bias}
    print(f"model: {model_dir}  prompt: {len(prompt)} tokens  generate: {args.tokens}")

    server = mlxcel_server(model_dir, "-np", str(args.parallel), "-c", str(2048 * args.parallel))
    http: list[float] = []
    local: list[float] = []
    http_cpu: list[float] = []
    local_cpu: list[float] = []
    with server:
        asyncio.run(_over_http(server.url, {**body, "max_tokens": 4}))  # warm-up both
        _in_process(model, tokenizer, prompt, 4, bias)
        assert server.proc is not None
        pid = server.proc.pid
        for rep in range(args.reps):
            cpu = _server_cpu(pid)
            rate, tokens = asyncio.run(_over_http(server.url, body))
            cpu = _server_cpu(pid) - cpu
            http.append(rate)
            http_cpu.append(tokens / cpu if cpu > 0 else 0.0)
            rate, per_cpu = _in_process(model, tokenizer, prompt, args.tokens, bias)
            local.append(rate)
            local_cpu.append(per_cpu)
            print(
                f"rep {rep + 1}: mlxcel serve (HTTP/SSE) {http[-1]:6.1f} tok/s "
                f"{http_cpu[-1]:6.1f} tok/CPU-s ({tokens} tokens)  stream_generate "
                f"{local[-1]:6.1f} tok/s {local_cpu[-1]:6.1f} tok/CPU-s  ({load_note()})",
                flush=True,
            )
    print()
    print(f"mlxcel serve, 1 client, SSE : {median(http):6.1f} tok/s  range {spread(http)}")
    print(f"mlx_lm.stream_generate      : {median(local):6.1f} tok/s  range {spread(local)}")
    print(f"BLAS: {blas_in_use()}")
    ratios = [h / s for h, s in zip(http, local, strict=True)]
    print(
        f"ratio of medians = {median(http) / median(local):.3f}x  "
        f"(median of paired ratios {median(ratios):.3f}x; target >= {TARGET}x)"
    )
    if all(http_cpu) and all(local_cpu):
        print(
            f"tokens per CPU-second: mlxcel serve {median(http_cpu):.1f}, stream_generate "
            f"{median(local_cpu):.1f}, ratio {median(http_cpu) / median(local_cpu):.3f}x"
        )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
