"""`--kv-unified` through a real `mlxcel serve`: every slot may use the whole `-c`, and the
tokens all running requests hold stay within it together.

Observed on llama-server (d32676d, tiny-llama, `-c 256 -np 4 -kvu`): /props
`default_generation_settings.n_ctx` and each /slots `n_ctx` are 256, a prompt over 256 tokens
is the usual 400 with `n_ctx` 256, and when the running requests outgrow the shared 256
tokens every one of them fails with a 500 `server_error` (an SSE `error` event mid-stream)
while a request that finished before keeps its full answer. Without the flag (`-np 4` given,
`-no-kvu`) each slot has 256 / 4 = 64 tokens. Without `-np` the flag is on (llama-server's
"enabled if number of slots is auto").

Requests use `ignore_eos`, so each one runs exactly to its `n_predict`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import API_KEY, AUTH, ServeProcess
from sse_reader import sse_json

from mlxcel.config import Settings
from mlxcel.server.boot import plan_slots

CTX = 256
SLOTS = 4
EXCEEDED = "context size has been exceeded"


def _args(model: Path, *extra: str) -> list[str]:
    return ["-m", str(model), "-c", str(CTX), "--api-key", API_KEY, *extra]


@pytest.fixture(scope="module")
def unified(tiny_llama_dir: Path) -> Iterator[str]:
    with ServeProcess(_args(tiny_llama_dir, "-np", str(SLOTS), "-kvu")).start() as proc:
        yield proc.url


@pytest.fixture(scope="module")
def split(tiny_llama_dir: Path) -> Iterator[str]:
    with ServeProcess(_args(tiny_llama_dir, "-np", str(SLOTS))).start() as proc:
        yield proc.url


def _complete(url: str, n_predict: int, **extra: Any) -> httpx.Response:
    body = {"prompt": "A", "n_predict": n_predict, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/completion", json=body, headers=AUTH, timeout=120)


def _together(url: str, n_predicts: list[int]) -> list[httpx.Response]:
    """The requests sent at once, one thread each, in order of `n_predicts`."""
    out: list[httpx.Response | None] = [None] * len(n_predicts)
    ready = threading.Barrier(len(n_predicts))

    def run(i: int, n: int) -> None:
        ready.wait()
        out[i] = _complete(url, n)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(n_predicts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def _n_ctx(url: str) -> tuple[int, list[int]]:
    props = httpx.get(f"{url}/props", headers=AUTH, timeout=30).json()
    slots = httpx.get(f"{url}/slots", headers=AUTH, timeout=30).json()
    return props["default_generation_settings"]["n_ctx"], [s["n_ctx"] for s in slots]


def _assert_exceeded(response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "server_error" and EXCEEDED in error["message"]
    assert f"of the {CTX} the slots share" in error["message"]


# ----------------------------------------------------------------- context per slot


def test_unified_slots_report_the_whole_context(unified: str, split: str) -> None:
    assert _n_ctx(unified) == (CTX, [CTX] * SLOTS)
    assert _n_ctx(split) == (CTX // SLOTS, [CTX // SLOTS] * SLOTS)


def test_a_request_longer_than_its_share_runs_to_n_predict_only_when_unified(
    unified: str, split: str
) -> None:
    n_predict = 3 * CTX // SLOTS  # 192: three slots' worth of the split context
    answer = _complete(unified, n_predict)
    assert answer.status_code == 200
    body = answer.json()
    assert body["timings"]["predicted_n"] == body["tokens_predicted"] == n_predict
    assert body["stop_type"] == "limit" and body["truncated"] is False
    n_prompt = body["tokens_evaluated"]
    cut = _complete(split, n_predict).json()
    assert cut["timings"]["predicted_n"] == CTX // SLOTS - n_prompt  # the slot's 64 tokens
    assert cut["truncated"] is True


def test_an_over_long_prompt_reports_the_whole_context(unified: str) -> None:
    answer = httpx.post(
        f"{unified}/completion",
        json={"prompt": "A " * (CTX + 20), "n_predict": 4},
        headers=AUTH,
        timeout=60,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["n_ctx"] == CTX and error["n_prompt_tokens"] > CTX


# ------------------------------------------------------------------- the shared pool


def test_requests_that_fit_the_pool_together_all_finish(unified: str) -> None:
    n_predicts = [100, 100, 30]  # each over 64, together 101 + 101 + 31 + prompts < 256
    for answer, n in zip(_together(unified, n_predicts), n_predicts, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["timings"]["predicted_n"] == n


def test_outgrowing_the_pool_fails_every_running_request(unified: str) -> None:
    # Two 200-token requests need ~400 of the 256 shared tokens: both fail, neither is cut
    # short with a 200 (llama-server's answer: a 500 to every processing slot).
    for answer in _together(unified, [200, 200]):
        _assert_exceeded(answer)
    # The slots and the pool are free again afterwards: one 200-token request fits alone.
    alone = _complete(unified, 200)
    assert alone.status_code == 200 and alone.json()["timings"]["predicted_n"] == 200
    assert all(not s["is_processing"] for s in httpx.get(f"{unified}/slots", headers=AUTH).json())


def test_a_request_done_before_the_pool_runs_out_keeps_its_answer(unified: str) -> None:
    # llama-server's 90, 90, 40, 90: the short one ends (and frees its tokens) long before
    # the three long ones outgrow the pool together; they fail, it succeeds.
    short, *long = _together(unified, [20, 200, 200, 200])
    assert short.status_code == 200 and short.json()["timings"]["predicted_n"] == 20
    for answer in long:
        _assert_exceeded(answer)


def test_a_stream_that_outgrows_the_pool_ends_with_an_error_event(unified: str) -> None:
    events: list[list[dict[str, Any]]] = [[], []]
    ready = threading.Barrier(2)

    def run(i: int) -> None:
        ready.wait()
        body = {"prompt": "A", "n_predict": 200, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{unified}/completion", json=body, headers=AUTH, timeout=120
        ) as response:
            assert response.status_code == 200
            events[i].extend(sse_json(response.iter_lines()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = 0  # the KV tokens of both once their last streamed token was sampled
    for stream in events:
        *tokens, last = stream
        assert tokens and all("content" in e and e["stop"] is False for e in tokens)
        assert len(tokens) < 200
        assert EXCEEDED in last["error"]["message"] and last["error"]["type"] == "server_error"
        held += tokens[-1]["tokens_evaluated"] + len(tokens) - 1  # that token not fed back
    # They fail at the first step that does not fit (one more token each), not before.
    assert held <= CTX < held + 2


# ------------------------------------------------------------ how the flag is set


@pytest.mark.parametrize(
    ("extra", "env", "per_slot"),
    [
        ((), {}, CTX),  # -np not given: on
        (("-no-kvu",), {}, CTX // SLOTS),  # off even with auto slots
        (("-np", str(SLOTS)), {"LLAMA_ARG_KV_UNIFIED": "1"}, CTX),
        (("-np", str(SLOTS), "--no-kv-unified"), {"LLAMA_ARG_KV_UNIFIED": "1"}, CTX // SLOTS),
    ],
    ids=["auto-slots", "no-kvu", "env-on", "option-beats-env"],
)
def test_flag_env_and_default(
    tiny_llama_dir: Path, extra: tuple[str, ...], env: dict[str, str], per_slot: int
) -> None:
    with ServeProcess(_args(tiny_llama_dir, *extra, "--no-warmup"), env=env).start() as proc:
        assert _n_ctx(proc.url) == (per_slot, [per_slot] * SLOTS)
        shared = f"{SLOTS} slots x {per_slot} tokens, {CTX} shared (--kv-unified)"
        assert (shared in proc.stderr) is (per_slot == CTX)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"parallel": -1, "ctx_size": 4096}, (4, 4096, 4096)),
        ({"parallel": 4, "ctx_size": 4096}, (4, 1024, None)),
        ({"parallel": 4, "ctx_size": 4096, "kv_unified": True}, (4, 4096, 4096)),
        ({"parallel": -1, "ctx_size": 4096, "kv_unified": False}, (4, 1024, None)),
        ({"parallel": -1, "ctx_size": 0}, (4, 2048, 2048)),  # the model's context is the pool
        ({"parallel": 2, "ctx_size": 0}, (2, 2048, None)),
    ],
)
def test_slot_plan(settings: dict[str, Any], expected: tuple[int, int, int | None]) -> None:
    plan = plan_slots(Settings(**settings), 2048)
    assert (plan.slots, plan.context_per_slot, plan.kv_pool) == expected
