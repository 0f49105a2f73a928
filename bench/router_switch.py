"""Router mode: what switching models costs (issue 30).

One `mlxcel serve --models-dir DIR --models-max 1` with two real models: the shipped
SmolLM2-135M Q4_1 GGUF and Gemma 3 270M Q4_K_M (its four installed chunks joined). Both are
loaded once first, so every later load reads warm disk (the converted model store and the OS
page cache). Each round, for each model in turn:

- `first`: a one-token chat request for the model that is not loaded: it waits while the
  other model is unloaded and this one loads, then is answered;
- `warm`: the same request again, the model loaded;
- `load`: `POST /models/unload` then `POST /models/load` of the model alone (the switch
  without a request).

It prints each model's medians and spreads over the rounds, `first / warm`, measured in
this one run, and the server's resident memory after each switch (flat: an unloaded model
leaves nothing behind). `--overhead N` then measures what routing adds to a request: N one-token
chat requests to SmolLM2 served by `mlxcel serve -m FILE` and by the router (the model
loaded), the two servers taking turns, 10 requests at a time; it prints each median and
router / single. `--switches N` then counts what N switches leave behind: the server's
threads (`/proc/PID/task`) and resident memory after each, alternating the two models at
`--models-max 1` (bounded: engine threads are reused across loads, `engine/engine_threads.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
from _common import BENCH_DIR, Server, free_port, load_note, mlxcel_server
from gguf_vs_llama import shipped_gemma3

MESSAGES = [{"role": "user", "content": "Say hi."}]


def models_dir() -> Path:
    """BENCH_DIR/router-models with links to the two shipped models."""
    from mlxcel.engine.loading.default_model import default_model_path

    root = BENCH_DIR / "router-models"
    root.mkdir(parents=True, exist_ok=True)
    for name, target in (
        ("smollm2-135m.gguf", default_model_path()),
        ("gemma-3-270m.gguf", Path(shipped_gemma3())),
    ):
        link = root / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return root


def one_token(client: httpx.Client, model: str) -> float:
    """Seconds for a one-token chat answer from `model`."""
    start = time.perf_counter()
    response = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    )
    response.raise_for_status()
    return time.perf_counter() - start


def resident_mib(server: Server) -> int:
    """The server process's resident memory (Linux /proc), MiB."""
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return -1


def thread_count(server: Server) -> int:
    """The server process's threads, native ones included (Linux /proc)."""
    assert server.proc is not None
    return len(list(Path(f"/proc/{server.proc.pid}/task").iterdir()))


def timed(client: httpx.Client, path: str, model: str) -> float:
    start = time.perf_counter()
    client.post(path, json={"model": model}).raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("--overhead", type=int, default=0, metavar="N")
    parser.add_argument("--switches", type=int, default=0, metavar="N")
    args = parser.parse_args()
    root = models_dir()
    if args.rounds:
        switch(root, args.rounds)
    if args.switches:
        leftovers(root, args.switches)
    if args.overhead:
        overhead(root, args.overhead)


def router_server(root: Path, *extra: str) -> Server:
    """`mlxcel serve --models-dir ROOT` on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "mlxcel", "serve", "--models-dir", str(root)]
    argv += ["-c", "2048", "--host", "127.0.0.1", "--port", str(port), *extra]
    return Server("mlxcel serve (router)", argv, port, "/health")


def overhead(root: Path, requests: int) -> None:
    """Median one-token latency on SmolLM2: single-model server vs router."""
    from mlxcel.engine.loading.default_model import default_model_path

    single = mlxcel_server(default_model_path(), "-c", "2048")
    router = router_server(root)
    times: dict[str, list[float]] = {"single": [], "router": []}
    with single, router:
        clients = {
            "single": httpx.Client(base_url=single.url, timeout=600),
            "router": httpx.Client(base_url=router.url, timeout=600),
        }
        for client in clients.values():
            one_token(client, "smollm2-135m")  # loads it on the router; warms both
        done = 0
        while done < requests:
            for label, client in clients.items():
                for _ in range(min(10, requests - done)):
                    times[label].append(one_token(client, "smollm2-135m"))
            done += 10
        for client in clients.values():
            client.close()
    single_median = statistics.median(times["single"])
    router_median = statistics.median(times["router"])
    print(f"routing overhead, {requests} one-token requests each to SmolLM2; {load_note()}")
    print(f"  mlxcel serve -m: median {single_median * 1000:.1f} ms")
    print(f"  router (model loaded): median {router_median * 1000:.1f} ms")
    print(f"  router / single: {router_median / single_median:.3f}")


def switch(root: Path, rounds: int) -> None:
    """The switch figures (see the module doc)."""
    names = ["gemma-3-270m", "smollm2-135m"]
    figures: dict[tuple[str, str], list[float]] = {
        (key, name): [] for key in ("first", "warm", "load") for name in names
    }
    server = router_server(root, "--models-max", "1")
    with server, httpx.Client(base_url=server.url, timeout=600) as client:
        for name in names:  # converts each GGUF once: later loads read warm disk
            one_token(client, name)
        rss: list[int] = []
        for _ in range(rounds):
            for name in names:
                figures["first", name].append(one_token(client, name))
                rss.append(resident_mib(server))
                figures["warm", name].append(one_token(client, name))
                timed(client, "/models/unload", name)
                figures["load", name].append(timed(client, "/models/load", name))
    print(f"router switch, --models-max 1, {rounds} rounds; {load_note()}")
    for name in names:
        print(f"{name}:")
        for key, label in (
            ("first", "first request while the other model is loaded (switch + answer)"),
            ("warm", "the same request, the model loaded"),
            ("load", "POST /models/load alone (warm disk)"),
        ):
            values = figures[key, name]
            low, high = min(values), max(values)
            print(f"  {label}: median {statistics.median(values):.3f} s ({low:.3f}-{high:.3f})")
        first = statistics.median(figures["first", name])
        print(f"  first / warm: {first / statistics.median(figures['warm', name]):.1f}x")
    print(f"server RSS after each switch, MiB: {' '.join(str(r) for r in rss)}")


def leftovers(root: Path, switches: int) -> None:
    """Threads and RSS of the router after each of `switches` model switches."""
    names = ["gemma-3-270m", "smollm2-135m"]
    server = router_server(root, "--models-max", "1")
    with server, httpx.Client(base_url=server.url, timeout=600) as client:
        one_token(client, names[1])
        threads, rss = [thread_count(server)], [resident_mib(server)]
        for i in range(switches):
            one_token(client, names[i % 2])
            threads.append(thread_count(server))
            rss.append(resident_mib(server))
    print(f"router, {switches} switches at --models-max 1; {load_note()}")
    print("  (the first figure before the first switch, then one after each)")
    print(f"  threads: {' '.join(str(t) for t in threads)}")
    print(f"  RSS, MiB: {' '.join(str(r) for r in rss)}")
    grown = threads[-1] - threads[0]
    print(f"  threads last - first: {grown:+d}; RSS last / first: {rss[-1] / rss[0]:.2f}")


if __name__ == "__main__":
    main()
