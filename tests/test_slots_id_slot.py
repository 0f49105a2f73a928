"""A request's `id_slot` (llama-server's field; -1 = any slot): it runs in that slot, waiting
for it while it is busy, starts from what that slot holds, and answers with that `id_slot`;
a slot the server does not have is a 400 in the OpenAI error shape. Then llama.cpp's
`test_slot_save` scenario (pinned requests, save slot 1, restore into slot 0) as counts of
this model's tokens, on a server started as the suite starts it (`--no-slots`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServeProcess

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, SamplingParams

FRANCE = "What is the capital of France? Tell me about its museums and its rivers"
GERMANY = "What is the capital of Germany? Tell me about its museums and its rivers"


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


def _request(loaded: Any, n: int, id_slot: int = -1) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=loaded.tokenizer.encode(FRANCE),
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        id_slot=id_slot,
    )


def _engine(loaded: Any, slots: int = 2) -> Any:
    from mlxcel.engine.text.scheduler import TextEngine

    return TextEngine(loaded, slots=slots, context_per_slot=512).start()


def test_a_pinned_request_runs_in_its_slot(loaded: Any) -> None:
    engine = _engine(loaded)
    try:
        for slot in (1, 0, 1):
            *_, final = engine.generate(_request(loaded, 3, slot))
            assert final.error is None and final.slot == slot
        *_, final = engine.generate(_request(loaded, 3))  # any: the lowest free one
        assert final.slot == 0
    finally:
        engine.stop()


@pytest.mark.parametrize("slot", [2, 7, -2])
def test_a_slot_the_engine_does_not_have_is_refused(loaded: Any, slot: int) -> None:
    engine = _engine(loaded)
    try:
        with pytest.raises(InvalidRequestError, match=f"id_slot {slot} is out of range"):
            engine.submit(_request(loaded, 3, slot), lambda event: None)
    finally:
        engine.stop()


def test_a_pinned_request_waits_for_its_busy_slot(loaded: Any) -> None:
    """Two requests pinned to slot 1 run one after the other while an unpinned one takes
    slot 0 meanwhile."""
    engine = _engine(loaded)
    order: list[tuple[str, GenerationEvent]] = []
    lock = threading.Lock()
    done = threading.Event()
    requests = {
        "first": _request(loaded, 24, 1),
        "second": _request(loaded, 4, 1),
        "any": _request(loaded, 4),
    }

    def sink(name: str) -> Any:
        def put(event: GenerationEvent) -> None:
            with lock:
                order.append((name, event))
                if sum(e.finished for _, e in order) == len(requests):
                    done.set()

        return put

    try:
        for name, request in requests.items():
            engine.submit(request, sink(name))
        assert done.wait(120)
    finally:
        engine.stop()
    finals = {name: e for name, e in order if e.finished}
    assert finals["first"].slot == finals["second"].slot == 1
    assert finals["any"].slot == 0
    assert all(e.error is None for e in finals.values())
    tokens = [name for name, e in order if e.token_ids]
    first_end = next(i for i, (name, e) in enumerate(order) if name == "first" and e.finished)
    second_start = next(i for i, (name, e) in enumerate(order) if name == "second" and e.token_ids)
    assert second_start > first_end  # it waited for slot 1
    assert tokens.index("any") < first_end  # slot 0 did not wait


# ------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServeProcess]:
    saved = tmp_path_factory.mktemp("pinned-slots")
    proc = ServeProcess(
        ["-m", str(tiny_llama_dir), "-np", "2", "-c", "2048", "--no-warmup",
         "--slot-save-path", str(saved), "--temp", "0", "--no-slots"],
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def _complete(client: httpx.Client, prompt: str, id_slot: int) -> dict[str, Any]:
    body = {"prompt": prompt, "id_slot": id_slot, "cache_prompt": True, "n_predict": 16}
    response = client.post("/completion", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    assert answer["id_slot"] == id_slot
    return answer


def _tokens(client: httpx.Client, text: str) -> list[int]:
    response = client.post("/tokenize", json={"content": text, "add_special": True})
    ids: list[int] = response.json()["tokens"]
    return ids


def _common(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_slot_actions_need_only_the_save_path(server: ServeProcess) -> None:
    """As llama-server (and its suite, which starts servers with `--no-slots`): `--no-slots`
    turns off the monitoring endpoint, not the slot actions `--slot-save-path` enables."""
    with server.client() as client:
        assert client.get("/slots").status_code == 501
        _complete(client, FRANCE, 0)
        saved = client.post("/slots/0?action=save", json={"filename": "no-slots.bin"})
        assert saved.status_code == 200, saved.text
        assert client.post("/slots/0?action=erase").status_code == 200


def test_llama_cpp_slot_save_restore(server: ServeProcess) -> None:
    """llama.cpp's test_slot_save_restore with this model's counts: slot 1 computes the
    whole prompt; saved; slot 1 then computes only what Germany's prompt does not share;
    the file restored into slot 0 gives slot 0 the same start; slot 1, not overwritten by
    that restore, computes one token of Germany's prompt."""
    with server.client() as client:
        france, germany = _tokens(client, FRANCE), _tokens(client, GERMANY)
        shared = _common(france, germany)
        assert 0 < shared < len(germany) - 1
        first = _complete(client, FRANCE, 1)
        assert first["timings"]["prompt_n"] == len(france)  # all tokens are processed
        saved = client.post("/slots/1?action=save", json={"filename": "slot1.bin"})
        assert saved.status_code == 200, saved.text
        n_saved = saved.json()["n_saved"]
        cached = first["tokens_cached"]  # the prompt and what was generated
        assert cached <= n_saved <= cached + 1
        answer = _complete(client, GERMANY, 1)
        assert answer["timings"]["prompt_n"] == len(germany) - shared
        restored = client.post("/slots/0?action=restore", json={"filename": "slot1.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n_saved
        answer = _complete(client, GERMANY, 0)
        assert answer["timings"]["prompt_n"] == len(germany) - shared  # from the file
        answer = _complete(client, GERMANY, 1)
        assert answer["timings"]["prompt_n"] == 1  # slot 1 still holds Germany's prompt


def test_llama_cpp_slot_erase(server: ServeProcess) -> None:
    with server.client() as client:
        prompt = "Erased: " + FRANCE
        n = len(_tokens(client, prompt))
        assert client.post("/slots/1?action=erase").status_code == 200  # as a fresh server's
        assert _complete(client, prompt, 1)["timings"]["prompt_n"] == n
        assert client.post("/slots/1?action=erase").status_code == 200
        assert _complete(client, prompt, 1)["timings"]["prompt_n"] == n  # all again


@pytest.mark.parametrize("slot", [2, 99, -5])
@pytest.mark.parametrize("route", ["/completion", "/v1/chat/completions", "/v1/completions"])
def test_an_id_slot_out_of_range_is_a_400(server: ServeProcess, route: str, slot: int) -> None:
    body: dict[str, Any] = {"id_slot": slot, "max_tokens": 2}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with server.client() as client:
        response = client.post(route, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"id_slot {slot} is out of range" in error["message"]
        assert client.get("/health").status_code == 200


def test_a_chat_request_honours_id_slot(server: ServeProcess) -> None:
    """The OpenAI routes take llama-server's `id_slot` too: the slot a chat request ran in
    is the one `/slots` saves."""
    with server.client() as client:
        assert client.post("/slots/1?action=erase").status_code == 200  # slot 1 holds nothing
        messages = [{"role": "user", "content": "Pinned chat: " + FRANCE}]
        body = {"messages": messages, "id_slot": 1, "max_tokens": 4}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        saved = client.post("/slots/1?action=save", json={"filename": "chat.bin"})
        assert saved.status_code == 200, saved.text  # 400 "holds no cached tokens" elsewhere
        usage = response.json()["usage"]
        assert saved.json()["n_saved"] >= usage["prompt_tokens"]
