"""deploy/'s HAProxy recipe in front of two router replicas (`--models-dir`): requests naming
either model are all answered, by both replicas. Runs where haproxy is installed."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from fixtures.haproxy import haproxy_cluster, require_haproxy

require_haproxy()


def test_haproxy_spreads_routed_requests_over_router_replicas(
    tiny_llama_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "chat-a").symlink_to(tiny_llama_dir)
    (models / "chat-b.gguf").symlink_to(tiny_gguf)
    args = ["--models-dir", str(models), "-np", "2", "-c", "1024", "--no-warmup"]
    with haproxy_cluster(args, 2, tmp_path) as cluster:
        url = cluster.url

        def complete(model: str) -> tuple[int, str, str]:
            body = {"model": model, "prompt": "The river", "n_predict": 16, "ignore_eos": True}
            response = httpx.post(f"{url}/completion", json=body, timeout=120)
            return response.status_code, response.headers.get("x-served-by", ""), model

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(complete, ["chat-a", "chat-b"] * 8))
        assert all(status == 200 for status, _, _ in results), results
        served = Counter((server, model) for _, server, model in results)
        assert {server for server, _ in served} == {"r1", "r2"}, served
        listed = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in listed["data"]] == ["chat-a", "chat-b"]
