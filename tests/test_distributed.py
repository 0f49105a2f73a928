"""One model split across two ranks (`mlx.launch --backend ring` on 127.0.0.1).

Rank 0 serves; rank 1 follows its steps. Greedy output tensor-parallel (llama, a GGUF
file too) and pipeline-parallel (qwen2) equals one process's token for token, with
requests batched together, a cached prefix and a cancelled stream; a killed follower
makes /health answer 503 and requests be refused, with no hang; a family that cannot be
split and `--distributed` outside a launcher stop before listening (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.rank_group import MLX_LAUNCH, RankGroup

pytestmark = pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch is not installed")

PROMPTS = [
    "Tell me about the morning train and the station.",
    "Count the boxes: 12, 24, 36, 48.",
    "Where are you going before the market closes?",
]
N_PREDICT = 16
SERVE = ["-np", "4", "-c", "2048"]


def _reference(
    model: Path, prompts: list[list[int]], n: int, cpu_dtype: str = "auto"
) -> list[list[int]]:
    """One process's greedy tokens for each prompt (the engine the server runs)."""
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.scheduler import TextEngine

    loaded = load_model(str(model), cpu_dtype=cpu_dtype)
    engine = TextEngine(loaded, slots=1)
    try:
        out = []
        for tokens in prompts:
            request = GenerationRequest(
                prompt_tokens=list(tokens),
                max_tokens=n,
                sampling=SamplingParams(temperature=0.0),
                ignore_eos=True,
                cache_prompt=False,
            )
            out.append([t for ev in engine.generate(request) for t in ev.token_ids])
        return out
    finally:
        engine.stop()


def _tokenize(client: httpx.Client, text: str) -> list[int]:
    response = client.post("/tokenize", json={"content": text, "add_special": True})
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]


def _complete(client: httpx.Client, tokens: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "prompt": tokens,
        "n_predict": N_PREDICT,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
        **extra,
    }
    response = client.post("/completion", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _concurrently(client: httpx.Client, prompts: list[list[int]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in prompts]

    def one(i: int) -> None:
        results[i] = _complete(client, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _cancel_a_stream(client: httpx.Client, tokens: list[int]) -> None:
    """Open a long stream, read two chunks, close it: the server cancels the request."""
    body = {"prompt": tokens, "n_predict": 400, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/completion", json=body) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data:"):
                chunks += 1
                if chunks >= 2:
                    break


def _wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = dict(client.get("/health").json())
        if body.get("batch", {}).get("active_sequences") == 0 or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def _check_group(group: RankGroup, model: Path, mode: str, cpu_dtype: str = "auto") -> None:
    """The group's greedy tokens equal one process's, batched, cached and after a cancel."""
    with group.client() as client:
        props = client.get("/props").json()
        assert props["world_size"] == 2
        assert f"rank 0 of 2 ({mode} parallel)" in group.output
        assert f"rank 1 of 2 ({mode} parallel) following rank 0" in group.output
        prompts = [_tokenize(client, text) for text in PROMPTS]
        expected = _reference(model, prompts, N_PREDICT, cpu_dtype)
        assert len({tuple(e) for e in expected}) > 1  # the prompts give different outputs
        batched = _concurrently(client, prompts)
        assert [r["tokens"] for r in batched] == expected
        again = _complete(client, prompts[0])  # its prefix is now in every rank's cache
        assert again["tokens"] == expected[0]
        assert again["timings"]["cache_n"] > 0
        pinned = _complete(client, prompts[2], id_slot=1)  # a slot of rank 0's choosing
        assert pinned["tokens"] == expected[2] and pinned["id_slot"] == 1
        _cancel_a_stream(client, prompts[1])
        # A request whose sampling only rank 0 shapes (a grammar, log-probabilities, a
        # temperature): the ranks stay in step through it.
        shaped = client.post(
            "/completion",
            json={
                "prompt": PROMPTS[0],
                "n_predict": 8,
                "temperature": 0.9,
                "n_probs": 2,
                "grammar": "root ::= [a-z]+",
            },
        )
        assert shaped.status_code == 200, shaped.text
        assert re.fullmatch("[a-z]+", shaped.json()["content"]), shaped.json()["content"]
        assert shaped.json()["completion_probabilities"]
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 4},
        )
        assert chat.status_code == 200, chat.text
        health = _wait_idle(client)
        assert health["status"] == "ok" and health["batch"]["active_sequences"] == 0
        after = _concurrently(client, [prompts[2], prompts[1]])
        assert [r["tokens"] for r in after] == [expected[2], expected[1]]


def test_tensor_parallel_matches_one_process(tiny_llama_dir: Path) -> None:
    with RankGroup(["-m", str(tiny_llama_dir), *SERVE]) as group:
        _check_group(group, tiny_llama_dir, "tensor")
        bench = subprocess.run(
            [sys.executable, "-m", "mlxcel", "bench", "serve", "--url", group.url, "-c", "2",
             "-N", "2", "-n", "4", "--prompt-len", "8", "--no-warmup", "--json"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        report = json.loads(bench.stdout)
        assert report["world_size"] == 2
        assert report["levels"][0]["completed"] == 2
    assert "Traceback" not in group.output


def test_generate_under_mlx_launch_prints_one_process_text(tiny_llama_dir: Path) -> None:
    # --json: one line written at once (the launcher relays output in chunks, and may cut
    # a streamed multi-byte character in two).
    args = ["-m", str(tiny_llama_dir), "-n", "12", "--temp", "0", "--json", "Hello there"]
    alone = subprocess.run(
        [sys.executable, "-m", "mlxcel", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert alone.returncode == 0, alone.stderr
    expected = json.loads(alone.stdout)["text"]
    group = RankGroup(args, command="generate").launch()
    try:
        assert group.wait_exit(120) == [0]
    finally:
        group.stop()
    answers = [json.loads(line) for line in group.lines if line.startswith("{")]
    assert [a["text"] for a in answers] == [expected], group.output  # rank 0's alone
    assert "Traceback" not in group.output and "WARN" not in group.output


def test_pipeline_parallel_matches_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    from fixtures.tiny_models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=3)
    with RankGroup(["-m", str(model), "--pipeline", *SERVE]) as group:
        _check_group(group, model, "pipeline")
    assert "Traceback" not in group.output


def test_gguf_pipeline_parallel_matches_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A GGUF file is converted whole, then each rank keeps only its layers."""
    from fixtures.tiny_models import build_tiny_model, write_tiny_gguf

    root = tmp_path_factory.mktemp("qwen2-gguf")
    model = write_tiny_gguf(
        build_tiny_model(root / "dir", "qwen2", seed=5), root / "q.gguf", "Q8_0"
    )
    args = ["-m", str(model), "--pipeline", "--cpu-dtype", "keep", *SERVE]
    with RankGroup(args) as group:
        _check_group(group, model, "pipeline", cpu_dtype="keep")


def test_gguf_tensor_parallel_matches_one_process(tiny_gguf: Path) -> None:
    # The sharded layers run MLX's quantized matmul, not mlxcel's CPU kernel (int8
    # activations): the one-process reference runs the same (`--cpu-dtype keep`).
    with RankGroup(["-m", str(tiny_gguf), "--cpu-dtype", "keep", *SERVE]) as group:
        _check_group(group, tiny_gguf, "tensor", cpu_dtype="keep")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_lost_follower_makes_rank_0_refuse_work(tiny_llama_dir: Path, how: int) -> None:
    """Ranks started as mlx.launch starts them, but without the launcher (which would stop
    rank 0 too): rank 1 killed (its sockets close) or frozen (they stay open: only the
    watchdog sees it), rank 0 answers 503 on /health and refuses requests."""
    args = ["-m", str(tiny_llama_dir), *SERVE, "--distributed-timeout", "3"]
    with RankGroup(args, launcher=False) as group, group.client(timeout=10) as client:
        tokens = _tokenize(client, PROMPTS[0])
        assert _complete(client, tokens)["tokens"]
        os.kill(group.pid_of_rank(1), how)
        deadline = time.monotonic() + 60
        health = client.get("/health")
        while health.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            health = client.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "unavailable"  # the HAProxy check's word
        assert "distributed group" in health.json()["error"]
        if how == signal.SIGSTOP:  # the watchdog's, within --distributed-timeout
            error = "rank 1 of the distributed group stopped answering (no reply within 3 s)"
            assert error in health.json()["error"]
        started = time.monotonic()
        refused = client.post("/completion", json={"prompt": tokens, "n_predict": 4})
        assert refused.status_code == 503, refused.text
        assert "distributed group" in refused.json()["error"]["message"]
        assert time.monotonic() - started < 5  # refused at once, not after a hang
        assert group.procs[0].poll() is None  # rank 0 is still up and answering
        if how == signal.SIGSTOP:
            os.kill(group.pid_of_rank(1), signal.SIGCONT)  # so that it can be stopped


def test_frozen_rank_0_makes_the_follower_leave(tiny_llama_dir: Path) -> None:
    """Rank 0 frozen with SIGSTOP (its sockets stay open; without the launcher): the
    follower, blocked in a collective, hears no step for --distributed-timeout seconds and
    its watchdog ends it, exit 1, with one line."""
    args = ["-m", str(tiny_llama_dir), *SERVE, "--distributed-timeout", "3"]
    with RankGroup(args, launcher=False) as group:
        with group.client(timeout=10) as client:
            assert _complete(client, _tokenize(client, PROMPTS[0]))["tokens"]
        os.kill(group.pid_of_rank(0), signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            assert group.procs[1].wait(3 + 10) == 1, group.output
            assert time.monotonic() - frozen < 3 + 10
        finally:
            os.kill(group.pid_of_rank(0), signal.SIGCONT)  # so that it can be stopped
        for reader in group._readers[1:]:
            reader.join(2)
        lines = [line for line in group.output.splitlines() if "leaving the group" in line]
        assert lines == [
            "mlxcel: error: rank 1: no step for 3 s (rank 0 stopped answering); leaving the group"
        ]
        assert "Traceback" not in group.output


def test_stopping_rank_0_stops_the_followers(tiny_llama_dir: Path) -> None:
    """SIGTERM to rank 0 alone: it drains, tells the other ranks to stop, and all exit 0."""
    with RankGroup(["-m", str(tiny_llama_dir), *SERVE], launcher=False) as group:
        with group.client() as client:
            assert _complete(client, _tokenize(client, PROMPTS[0]))["tokens"]
        os.kill(group.pid_of_rank(0), signal.SIGTERM)
        assert group.wait_exit(60) == [0, 0], group.output
    assert "Traceback" not in group.output


def _refused_by_every_rank(args: list[str], command: str = "serve") -> str:
    """Start two ranks (without the launcher, which stops the other ranks when one fails
    and exits 0 itself); both must exit 2 before rank 0 listens: the first error line."""
    group = RankGroup(args, command=command, launcher=False).launch()
    try:
        codes = group.wait_exit(120)
    finally:
        group.stop()
    assert codes == [2, 2], group.output
    assert "listening on" not in group.output and "Traceback" not in group.output
    errors = [line for line in group.output.splitlines() if line.startswith("mlxcel: error:")]
    assert len(errors) == 2, group.output
    return errors[0]


def test_family_that_cannot_be_split_stops_before_listening(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from fixtures.tiny_gemma3 import write_tiny_gemma3_gguf

    model, _ = write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gemma") / "tiny-gemma3.gguf")
    error = _refused_by_every_rank(["-m", str(model), *SERVE])
    assert "gemma3_text family can be split across ranks neither" in error
    assert "tensor parallel: " in error and "llama" in error and "qwen2" in error


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--pipeline"], "the llama family cannot be split by layers; it can run tensor"),
        (["--slot-save-path", "{tmp}"], "--slot-save-path cannot be used with a distributed"),
    ],
)
def test_what_a_split_model_cannot_do_stops_before_listening(
    tiny_llama_dir: Path, tmp_path: Path, extra: list[str], needle: str
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    error = _refused_by_every_rank(["-m", str(tiny_llama_dir), *SERVE, *args])
    assert needle in error, error


def test_generate_pipeline_flag_reaches_the_split(tiny_llama_dir: Path) -> None:
    # `generate --pipeline` asks for layers as `serve --pipeline` does: llama has no
    # PipelineMixin, so both ranks refuse it with the same line.
    args = ["-m", str(tiny_llama_dir), "--pipeline", "-n", "1", "Hi"]
    error = _refused_by_every_rank(args, command="generate")
    assert "the llama family cannot be split by layers; it can run tensor" in error, error


def test_distributed_switch_outside_a_launcher_is_one_error(tiny_llama_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "OMPI_"))}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama_dir), "--distributed"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("mlxcel: error: --distributed:"), done.stderr
    assert "mlx.launch" in lines[-1] and "Traceback" not in done.stderr
    assert "listening on" not in done.stderr


def test_one_process_bench_under_a_launcher_points_to_bench_serve(tiny_llama_dir: Path) -> None:
    env = {**os.environ, "MLX_RANK": "0"}  # as mlx.launch sets it
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel", "bench", "-m", str(tiny_llama_dir), "-p", "8", "-n", "4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "mlxcel bench serve --url" in done.stderr and "Traceback" not in done.stderr


def test_each_rank_has_its_own_disk_tier(tmp_path: Path) -> None:
    """Ranks may share a disk, and a shard's KV shapes depend on the group and the split."""
    from mlxcel.config import Settings
    from mlxcel.engine.distributed.group import Ranks
    from mlxcel.server.distributed import rank_settings

    settings = Settings(prompt_cache_dir=str(tmp_path))
    one = rank_settings(settings, Ranks(group=None, rank=1, size=2))  # type: ignore[arg-type]
    assert one.prompt_cache_dir == str(tmp_path / "2-ranks-tensor" / "rank-1")
    pipeline = settings.model_copy(update={"pipeline": True})
    zero = rank_settings(pipeline, Ranks(group=None, rank=0, size=3))  # type: ignore[arg-type]
    assert zero.prompt_cache_dir == str(tmp_path / "3-ranks-pipeline" / "rank-0")
    assert rank_settings(settings, None) is settings
