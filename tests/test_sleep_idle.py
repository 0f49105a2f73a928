"""`--sleep-idle-seconds`: the model unloads after an idle spell and reloads on demand.

Through real `mlxcel serve` processes on the tiny llama: the server sleeps after the idle
time (`/props` says so, `/health` stays 200, the model list answers without waking it), a
completion wakes it and gets the same greedy text as before the sleep, `/tokenize` wakes it
as llama-server's does, concurrent requests share one reload, a stream in flight is never
idle, and without the flag the server never sleeps.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServeProcess
from sse_reader import iter_sse_json

from mlxcel.server.sleep import wakes_model

IDLE = 1
GREEDY = {"prompt": "Hello world", "n_predict": 8, "temperature": 0, "cache_prompt": False}


@pytest.fixture(scope="module")
def sleepy(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "65536", "--slots", "--metrics"]
    server = ServeProcess([*args, "--sleep-idle-seconds", str(IDLE)]).start()
    try:
        yield server
    finally:
        server.stop()


def is_sleeping(client: httpx.Client) -> bool:
    response = client.get("/props")
    assert response.status_code == 200
    value = response.json()["is_sleeping"]
    assert isinstance(value, bool)
    return value


def wait_asleep(client: httpx.Client, timeout: float = 20.0) -> float:
    """Poll /props until the server sleeps; the seconds it took."""
    start = time.monotonic()
    while not is_sleeping(client):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"the server did not sleep within {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - start


def complete(client: httpx.Client, **extra: Any) -> str:
    response = client.post("/completion", json={**GREEDY, **extra})
    assert response.status_code == 200, response.text
    content = response.json()["content"]
    assert isinstance(content, str)
    return content


def count(server: ServeProcess, text: str) -> int:
    return server.stderr.count(text)


def wait_logged(server: ServeProcess, text: str, times: int = 1, timeout: float = 10.0) -> None:
    """Wait until the server's stderr holds `text` `times` times (the line follows the
    state change: the model is marked asleep, then unloaded, then the line is written)."""
    deadline = time.monotonic() + timeout
    while count(server, text) < times:
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{server.stderr}"
        time.sleep(0.05)


def test_sleeps_when_idle_and_a_completion_wakes_it(sleepy: ServeProcess) -> None:
    with sleepy.client() as client:
        before = complete(client)
        assert before
        assert not is_sleeping(client)
        waited = wait_asleep(client)
        assert waited >= IDLE * 0.5  # counted from the request that just finished
        wait_logged(sleepy, "sleeping after 1 s idle: model unloaded")
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        models = client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"]
        assert client.get("/no-such-route").status_code == 404
        assert client.get("/completion").status_code == 405
        assert is_sleeping(client)  # neither /health, the model list nor a 404 woke it
        wakes = count(sleepy, "awake: model reloaded")
        after = complete(client)
        assert after == before  # the reloaded model gives the same greedy text
        assert not is_sleeping(client)
        assert count(sleepy, "awake: model reloaded") == wakes + 1


def test_tokenize_wakes_it_as_llama_server_does(sleepy: ServeProcess) -> None:
    with sleepy.client() as client:
        wait_asleep(client)
        response = client.post("/tokenize", json={"content": "Hello world"})
        assert response.status_code == 200
        assert response.json()["tokens"]
        assert not is_sleeping(client)


def test_concurrent_requests_share_one_reload(sleepy: ServeProcess) -> None:
    with sleepy.client() as client:
        expected = complete(client)
        wait_asleep(client)
        wakes = count(sleepy, "awake: model reloaded")
    results: list[str | BaseException] = []
    barrier = threading.Barrier(3)

    def one() -> None:
        with sleepy.client() as own:
            barrier.wait()
            try:
                results.append(complete(own))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [expected] * 3
    assert count(sleepy, "awake: model reloaded") == wakes + 1


def test_no_sleep_while_a_stream_is_in_flight(sleepy: ServeProcess) -> None:
    """A stream still generating after more than the idle time keeps the model awake. The
    request asks for more tokens than a slot's context holds, so it runs until its context
    is full (seconds on this model) unless the check has been made and the client leaves."""
    body = {
        "prompt": "Once upon a time",
        "n_predict": 60000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with sleepy.client() as client:
        complete(client)  # awake
        time.sleep(0.2)  # a line of an earlier sleep has reached the log
        sleeps = count(sleepy, "sleeping after")
        checked_at = 0.0
        start = time.monotonic()
        with client.stream("POST", "/completion", json=body) as response:
            assert response.status_code == 200
            for event in iter_sse_json(response.iter_lines()):
                if event.get("stop"):
                    break
                if time.monotonic() - start > IDLE * 1.5:
                    checked_at = time.monotonic() - start
                    with sleepy.client() as other:
                        assert not is_sleeping(other)
                    break  # leaving cancels the request
        assert checked_at, "the stream ended before the idle time passed"
        assert count(sleepy, "sleeping after") == sleeps
        wait_asleep(client)  # and once it is over, the server does sleep


def test_disabled_by_default(tiny_llama_dir: Path) -> None:
    with ServeProcess(["-m", str(tiny_llama_dir), "-np", "1"]) as server:
        with server.client() as client:
            complete(client)
            time.sleep(2.5)
            assert not is_sleeping(client)
        assert "sleep" not in server.stderr


@pytest.mark.parametrize(
    ("method", "path", "wakes"),
    [
        ("GET", "/health", False),
        ("GET", "/", False),
        ("GET", "/props", False),
        ("GET", "/v1/models", False),
        ("GET", "/v1/models/local", False),
        ("GET", "/models/org/name", False),
        ("POST", "/v1/embeddings", False),
        ("POST", "/v1/audio/transcriptions", False),
        ("POST", "/props", True),
        ("POST", "/completion", True),
        ("POST", "/v1/chat/completions", True),
        ("POST", "/tokenize", True),
        ("GET", "/slots", True),
        ("GET", "/metrics", True),
    ],
)
def test_which_routes_wake_the_model(method: str, path: str, wakes: bool) -> None:
    assert wakes_model(method, path) is wakes
    assert wakes_model(method, f"/api{path}", "/api") is wakes


def _wait_unloaded(engine: Any) -> None:
    """Until the engine is asleep and has dropped its model: `sleeping` turns true when the
    engine decides to sleep, a moment before its thread releases the network."""
    deadline = time.monotonic() + 10
    while not (engine.sleeping and engine.loaded.model is None):
        assert time.monotonic() < deadline, "the engine did not sleep"
        time.sleep(0.05)


def test_engine_survives_a_failed_reload(tiny_llama_dir: Path) -> None:
    """A reload that fails fails the waiting requests and leaves the engine asleep; the
    next request reloads again. The unloaded engine holds no network."""
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded

    loaded = load_model(str(tiny_llama_dir))
    failures = [RuntimeError("disk gone")]

    def reload() -> Reloaded:
        if failures:
            raise failures.pop()
        return Reloaded(load_model(str(tiny_llama_dir)).model)

    engine = TextEngine(loaded, sleep=IdleSleep(0.2, reload)).start()
    network = weakref.ref(loaded.model)
    del loaded
    prompt = engine.tokenizer.encode("Hello world")

    def run() -> list[Any]:
        request = GenerationRequest(
            prompt_tokens=prompt,
            max_tokens=6,
            cache_prompt=False,
            sampling=SamplingParams(temperature=0.0),
        )
        return list(engine.generate(request))

    try:
        first = run()
        assert first[-1].finish_reason == "length"
        _wait_unloaded(engine)
        assert engine.loaded.model is None
        gc.collect()
        assert network() is None  # nothing holds the unloaded network any more
        failed = run()
        assert failed[-1].finish_reason == "error"
        assert "disk gone" in (failed[-1].error or "")
        assert engine.sleeping and engine.loaded.model is None
        assert engine.wake().result(10) is None  # this wake reloads, and succeeds
        assert not engine.sleeping and engine.loaded.model is not None
        again = run()
        assert "".join(e.text for e in again) == "".join(e.text for e in first)
    finally:
        engine.stop()


def test_sleep_frees_the_draft_model_and_wake_restores_speculation(tiny_llama_dir: Path) -> None:
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded
    from mlxcel.engine.text.speculative import SpeculationConfig

    def speculation() -> SpeculationConfig:
        return SpeculationConfig("draft", n_max=4, n_min=0, draft=load_model(str(tiny_llama_dir)))

    def reload() -> Reloaded:
        return Reloaded(load_model(str(tiny_llama_dir)).model, speculation())

    loaded, config = load_model(str(tiny_llama_dir)), speculation()
    networks = [weakref.ref(loaded.model), weakref.ref(config.draft.model)]  # type: ignore[union-attr]
    engine = TextEngine(loaded, speculation=config, sleep=IdleSleep(0.2, reload)).start()
    del loaded, config
    prompt = engine.tokenizer.encode("Hello world")

    def run() -> list[Any]:
        greedy = SamplingParams(temperature=0.0)
        request = GenerationRequest(prompt_tokens=prompt, max_tokens=12, sampling=greedy)
        return list(engine.generate(request))

    try:
        first = run()
        assert first[-1].timings.draft_n > 0
        _wait_unloaded(engine)
        gc.collect()
        assert [ref() for ref in networks] == [None, None]
        again = run()
        assert again[-1].timings.draft_n > 0  # speculating again, with the reloaded draft
        assert "".join(e.text for e in again) == "".join(e.text for e in first)
    finally:
        engine.stop()


def test_a_vision_model_sleeps_and_wakes_too(tmp_path: Path) -> None:
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    import base64
    import io

    from fixtures.tiny_vlm import build_tiny_qwen2_vl
    from PIL import Image

    picture = Image.new("RGB", (64, 64), (0, 200, 0))
    for x in range(0, 64, 8):
        for y in range(64):
            picture.putpixel((x, y), (255, 55, 255))
    png = io.BytesIO()
    picture.save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the picture?"},
                    {"type": "image_url", "image_url": {"url": uri}},
                ],
            }
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    model = build_tiny_qwen2_vl(tmp_path / "qwen2vl")
    env = {"HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}
    args = ["-m", str(model), "-c", "2048", "--sleep-idle-seconds", str(IDLE)]
    with ServeProcess(args, env=env) as server, server.client() as client:

        def chat() -> str:
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            content = response.json()["choices"][0]["message"]["content"]
            assert isinstance(content, str)
            return content

        before = chat()
        wait_asleep(client)
        wait_logged(server, "model unloaded")
        assert chat() == before
        assert not is_sleeping(client)
        assert count(server, "awake: model reloaded") == 1


def test_a_sleeping_vision_engine_holds_no_network(tmp_path: Path) -> None:
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded
    from mlxcel.engine.vision.engine import VisionEngine
    from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
    from mlxcel.engine.vision.loader import load_vision_model

    path = build_tiny_qwen2_vl(tmp_path / "qwen2vl")
    loaded = load_vision_model(path, name="tiny")
    network = weakref.ref(loaded.model)
    sleep = IdleSleep(0.2, lambda: Reloaded(load_vision_model(path, name="tiny").model))
    engine = VisionEngine(loaded, sleep=sleep).start()
    del loaded
    prompt = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"

    def run() -> str:
        request = GenerationRequest(
            prompt_tokens=[],
            max_tokens=6,
            sampling=SamplingParams(temperature=0.0),
            media=VisionPrompt(prompt, VisionInputs()),
        )
        events = list(engine.generate(request))
        assert events[-1].finish_reason in ("length", "stop")
        return "".join(e.text for e in events)

    try:
        first = run()
        _wait_unloaded(engine)
        gc.collect()
        assert network() is None and engine.loaded.model is None
        assert run() == first
        assert not engine.sleeping
    finally:
        engine.stop()


def test_idle_clock_and_transitions() -> None:
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded

    now = [100.0]
    sleep = IdleSleep(5, lambda: Reloaded(None), clock=lambda: now[0])
    assert sleep.wait_timeout() == 5 and sleep.transition(busy=False) is None
    now[0] += 4
    sleep.touch()  # a request arrived or finished: the clock starts again
    now[0] += 4
    assert sleep.transition(busy=False) is None
    now[0] += 2
    assert sleep.transition(busy=True) is None  # a request in flight is never idle
    assert sleep.transition(busy=False) == "sleep" and sleep.asleep
    assert sleep.wait_timeout() is None  # asleep: wait until someone needs the model
    woken = sleep.ask_wake()
    assert not woken.done() and sleep.wait_timeout() == 0.0
    assert sleep.transition(busy=False) == "wake"
    failed = sleep.woke(RuntimeError("no disk"))
    assert sleep.asleep and failed == [woken]
    second = sleep.ask_wake()
    assert sleep.woke() == [second] and not sleep.asleep
    assert sleep.seconds_left() == 5  # awake again: the clock starts at the wake-up
    assert sleep.ask_wake().result(0) is None  # awake: resolved at once
    with pytest.raises(ValueError):
        IdleSleep(0, lambda: Reloaded(None))
