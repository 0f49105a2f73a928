"""The prompt cache's disk tier: time to first token of a request with a long prefix cold,
from RAM, and from disk after a restart, in one run.

Each repetition starts `mlxcel serve --prompt-cache-dir <fresh dir>` and sends one prompt of
about `-t` tokens three ways: cold (nothing cached), again (the RAM hit), and, after the
server is stopped (its prompt cache goes to disk) and started again, once more (the disk
hit: the entry read, checked and loaded). Each request asks for one token from
`/completion`, so its time is the prefill and one sampling step, measured at the client.
Targets: the disk hit within 3x of the RAM hit and at least 5x faster than cold.

    .venv/bin/python bench/prompt_disk.py [-m MODEL] [-t PREFIX_TOKENS] [-r REPS]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_model, load_note, median, mlxcel_server, spread  # noqa: E402

UNIT = "The keeper of the lighthouse wrote the weather, the ships and the tides in his log. "


def _prompt(url: str, tokens: int) -> tuple[str, int]:
    """A prompt of about `tokens` tokens (counted by the server's tokenizer)."""
    per_unit = len(httpx.post(url + "/tokenize", json={"content": UNIT}).json()["tokens"])
    text = UNIT * max(1, tokens // max(1, per_unit))
    return text, len(httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"])


def _request_ms(url: str, prompt: str) -> tuple[float, int]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True}
    start = time.perf_counter()
    response = httpx.post(url + "/completion", json=body, timeout=600)
    elapsed = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    return elapsed, int(response.json()["timings"]["cache_n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="model (default: 20M fp32 llama)")
    parser.add_argument("-t", "--prefix-tokens", type=int, default=4096)
    parser.add_argument("-r", "--reps", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(bench_model())
    times: dict[str, list[float]] = {"cold": [], "ram": [], "disk": []}
    n_tokens = 0
    for rep in range(args.reps):
        directory = Path(tempfile.mkdtemp(prefix="mlxcel-prompt-disk-"))
        extra = ("-np", "1", "-c", str(args.prefix_tokens + 512),
                 "--prompt-cache-dir", str(directory))  # fmt: skip
        try:
            server = mlxcel_server(model, *extra).start()
            try:
                prompt, n_tokens = _prompt(server.url, args.prefix_tokens)
                httpx.post(server.url + "/v1/cache/reset")
                cold, cached = _request_ms(server.url, prompt)
                assert cached == 0, cached
                ram, cached = _request_ms(server.url, prompt)
                assert cached > 0, "the RAM hit found nothing"
            finally:
                server.stop()
            server = mlxcel_server(model, *extra).start()
            try:
                disk, cached = _request_ms(server.url, prompt)
                assert cached > 0, "the disk hit found nothing"
            finally:
                server.stop()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        for name, value in (("cold", cold), ("ram", ram), ("disk", disk)):
            times[name].append(value)
        print(f"rep {rep + 1}: cold {cold:.0f} ms, RAM hit {ram:.0f} ms, disk hit "
              f"{disk:.0f} ms ({load_note()})", flush=True)  # fmt: skip
    cold, ram, disk = (median(times[k]) for k in ("cold", "ram", "disk"))
    print(f"\nmodel {model}, prompt {n_tokens} tokens, {args.reps} repetitions (median, range)")
    for name in ("cold", "ram", "disk"):
        print(f"  {name:5} {median(times[name]):8.0f} ms  ({spread(times[name])})")
    ratios = [d / r for d, r in zip(times["disk"], times["ram"], strict=True)]
    speedups = [c / d for c, d in zip(times["cold"], times["disk"], strict=True)]
    print(f"disk / RAM hit = {disk / ram:.2f}x (per rep {spread(ratios)}; target <= 3x)")
    print(f"cold / disk hit = {cold / disk:.1f}x (per rep {spread(speedups)}; target >= 5x)")


if __name__ == "__main__":
    main()
