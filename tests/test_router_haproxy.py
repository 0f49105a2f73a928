"""deploy/'s HAProxy recipe in front of two router replicas (`--models-dir`): requests naming
either model are all answered, by both replicas. Runs where haproxy is installed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_harness import ServeProcess, wait_healthy

ROOT = Path(__file__).resolve().parents[1]

if shutil.which("haproxy") is None:
    pytest.skip("haproxy is not installed (apt-get install haproxy)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_haproxy_spreads_routed_requests_over_router_replicas(
    tiny_llama_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "chat-a").symlink_to(tiny_llama_dir)
    (models / "chat-b.gguf").symlink_to(tiny_gguf)
    args = ["--models-dir", str(models), "-np", "2", "-c", "1024", "--no-warmup"]
    replicas = [ServeProcess(args) for _ in range(2)]
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for replica in replicas:
            replica.start()
        front = _free_port()
        addresses = [replica.url.removeprefix("http://") for replica in replicas]
        config = subprocess.run(
            [str(ROOT / "deploy" / "replicas.sh"), "config", str(front), *addresses],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        path = tmp_path / "haproxy.cfg"
        path.write_text(config)
        proxy = subprocess.Popen(
            ["haproxy", "-db", "-f", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        url = f"http://127.0.0.1:{front}"
        wait_healthy(url, time.monotonic() + 30, alive=lambda: proxy.poll() is None)
        time.sleep(1.5)  # every replica's first health check has passed

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
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for replica in replicas:
            replica.stop()
