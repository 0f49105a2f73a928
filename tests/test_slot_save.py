"""llama-server's slot save/restore/erase (`--slot-save-path`, `POST /slots/{id}?action=`):
a round trip through a file puts the slot's cache back (the next request reuses it), hostile
file names are refused, erase forgets the slot, missing or damaged files are clean 400s."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServeProcess

PROMPT = "Once upon a time there was a little robot who loved to count the stars in the sky"


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots") / "saved"  # the server creates it


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, save_dir: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        ["-m", str(tiny_llama_dir), "-np", "2", "-c", "2048", "--no-warmup",
         "--slot-save-path", str(save_dir)],
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def _complete(client: httpx.Client, prompt: str = PROMPT) -> dict[str, Any]:
    response = client.post(
        "/completion",
        json={"prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True},
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _action(client: httpx.Client, slot: int, action: str, **body: Any) -> httpx.Response:
    """POST /slots/{slot}?action=...; the body as ASCII JSON, so a lone surrogate goes out as
    its `\\ud800` escape (valid JSON, not valid Unicode)."""
    content = json.dumps(body).encode("ascii")
    headers = {"content-type": "application/json"}
    params = {"action": action}
    return client.post(f"/slots/{slot}", params=params, content=content, headers=headers)


def test_save_then_restore_puts_the_cache_back(server: ServeProcess, save_dir: Path) -> None:
    with server.client() as client:
        first = _complete(client)
        slot = first["id_slot"]
        saved = _action(client, slot, "save", filename="story.bin")
        assert saved.status_code == 200, saved.text
        body = saved.json()
        assert body["id_slot"] == slot and body["filename"] == "story.bin"
        n_saved = body["n_saved"]  # the cache's tokens: the prompt and what was generated
        assert first["tokens_cached"] <= n_saved <= first["tokens_cached"] + 1
        assert body["n_written"] == (save_dir / "story.bin").stat().st_size
        assert body["timings"]["save_ms"] >= 0
        assert client.post("/v1/cache/reset").status_code == 200
        cold = _complete(client)  # nothing cached now: the whole prompt is computed
        assert cold["timings"]["cache_n"] == 0
        assert client.post("/v1/cache/reset").status_code == 200
        restored = _action(client, 0, "restore", filename="story.bin")
        assert restored.status_code == 200, restored.text
        body = restored.json()
        assert body["id_slot"] == 0 and body["n_restored"] == n_saved
        assert body["n_read"] == (save_dir / "story.bin").stat().st_size
        assert "restore_ms" in body["timings"]
        again = _complete(client)
        assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1  # all but one
        assert again["content"] == first["content"]


@pytest.mark.parametrize(
    "name",
    ["../escape.bin", "/tmp/abs.bin", "", ".", "..", "a/b.bin", " lead.bin", "trail.", "x\x01y",
     "sub\\name", 7, None, "\ud800.bin", "x" * 100_000 + ".bin", {"a": [1]}],
)  # fmt: skip
def test_hostile_file_names_are_refused(server: ServeProcess, save_dir: Path, name: Any) -> None:
    with server.client() as client:
        _complete(client)
        for action in ("save", "restore"):
            response = _action(client, 0, action, filename=name)
            assert response.status_code == 400, (action, name, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert not (save_dir.parent / "escape.bin").exists()
    assert not Path("/tmp/abs.bin").exists()


def test_a_symbolic_link_is_refused(server: ServeProcess, save_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "outside.bin"
    target.write_bytes(b"keep")
    (save_dir / "link.bin").symlink_to(target)
    with server.client() as client:
        _complete(client)
        for action in ("save", "restore"):
            response = _action(client, 0, action, filename="link.bin")
            assert response.status_code == 400, response.text
    assert target.read_bytes() == b"keep"


def test_erase_forgets_the_slot(server: ServeProcess) -> None:
    with server.client() as client:
        prompt = "Erase me: " + PROMPT
        first = _complete(client, prompt)
        erased = _action(client, first["id_slot"], "erase")
        assert erased.status_code == 200
        body = erased.json()
        assert body["id_slot"] == first["id_slot"]
        assert first["tokens_cached"] <= body["n_erased"] <= first["tokens_cached"] + 1
        again = _complete(client, prompt)
        assert again["timings"]["cache_n"] == 0


def test_an_action_on_a_busy_slot_waits_for_its_task(server: ServeProcess) -> None:
    """llama-server defers a slot action until the slot's task ends. An erase sent while
    the slot generated answered at once (it forgot the slot's old cache) and the task then
    stored its own: the slot was not empty after a successful erase."""
    body = {
        "prompt": "Busy: " + PROMPT, "n_predict": 600, "ignore_eos": True, "stream": True,
        "id_slot": 1, "temperature": 0, "cache_prompt": True,
    }  # fmt: skip
    answers: list[httpx.Response] = []
    with server.client() as client, client.stream("POST", "/completion", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the slot is busy
        eraser = threading.Thread(target=lambda: answers.append(_action(client, 1, "erase")))
        eraser.start()
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: ")][-1]
        eraser.join(120)
    assert last["stop"] and last["tokens_predicted"] == 600
    (erased,) = answers
    assert erased.status_code == 200, erased.text
    # the finished task's cache: its prompt and what it generated
    assert erased.json()["n_erased"] >= last["tokens_evaluated"] + 599
    with server.client() as client:
        slots = client.get("/slots").json()
        assert not slots[1]["is_processing"]
        again = client.post("/completion", json={**body, "stream": False, "n_predict": 1})
        assert again.json()["timings"]["cache_n"] == 0


def test_missing_and_damaged_files_are_clean_errors(server: ServeProcess, save_dir: Path) -> None:
    with server.client() as client:
        first = _complete(client)
        assert _action(client, first["id_slot"], "save", filename="whole.bin").status_code == 200
        whole = (save_dir / "whole.bin").read_bytes()
        (save_dir / "cut.bin").write_bytes(whole[: len(whole) // 2])
        (save_dir / "junk.bin").write_bytes(os.urandom(4096))
        (save_dir / "empty.bin").write_bytes(b"")
        for name in ("nothing-here.bin", "cut.bin", "junk.bin", "empty.bin"):
            response = _action(client, 0, "restore", filename=name)
            assert response.status_code == 400, (name, response.text)
            assert "Unable to restore slot" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 200
        assert _complete(client)["content"] == first["content"]


def test_bad_actions_and_slots(server: ServeProcess) -> None:
    with server.client() as client:
        assert _action(client, 0, "explode").status_code == 400
        assert _action(client, 9, "erase").status_code == 400
        assert client.post("/slots/0", params={"action": "save"}, content=b"[1]").status_code == 400


def test_save_needs_a_slot_save_path(tiny_llama_dir: Path) -> None:
    proc = ServeProcess(["-m", str(tiny_llama_dir), "-np", "1", "--no-warmup"]).start()
    try:
        with proc.client() as client:
            response = _action(client, 0, "save", filename="x.bin")
            assert response.status_code == 501
            assert "--slot-save-path" in response.json()["error"]["message"]
            assert _action(client, 0, "erase").json() == {"id_slot": 0, "n_erased": 0}
    finally:
        proc.stop()


def test_a_file_of_another_kv_type_or_model_is_refused(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.engine.text.kv_types import kv_type, typed_cache
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.slot_files import SlotFileError, SlotFiles

    cache = PromptCache()
    layer = typed_cache([KVCache()], kv_type("f16"))
    rows = mx.random.normal((1, 2, 20, 32))
    layer[0].update_and_fetch(rows, rows)
    assert cache.insert(list(range(20)), layer, slot=0)
    saved = SlotFiles(tmp_path, cache, "f16", "m").save(0, "a.bin")
    assert saved.n_tokens == 20
    for kv, model in (("q8_0", "m"), ("f16", "other")):
        with pytest.raises(SlotFileError, match="saved with model"):
            SlotFiles(tmp_path, PromptCache(), kv, model).restore(0, "a.bin")
    target = PromptCache()
    assert SlotFiles(tmp_path, target, "f16", "m").restore(1, "a.bin").n_tokens == 20
    assert target.lookup(list(range(25)))[1] == 20  # loaded on the lookup
    held = target.slot_entry(1)
    assert held is not None and held[:2] == (list(range(20)), 20)
    assert held[2][0].keys.dtype == mx.float16 and type(held[2][0]) is type(layer[0])


def test_a_slot_extended_by_a_longer_sequence_saves_its_own_tokens(tmp_path: Path) -> None:
    """The entry serving slot 0 grew (slot 1 continued the same tokens): the file holds
    the entry, the restore gives back slot 0's 20 tokens only."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.engine.text.kv_types import kv_type, typed_cache
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.slot_files import SlotFiles

    cache = PromptCache()
    rows = mx.random.normal((1, 2, 30, 32))
    for slot, n in ((0, 20), (1, 30)):
        layer = typed_cache([KVCache()], kv_type("f16"))
        layer[0].update_and_fetch(rows[:, :, :n], rows[:, :, :n])
        cache.insert(list(range(n)), layer, slot=slot)
    assert len(cache) == 1  # the longer entry replaced the shorter one
    found = cache.slot_entry(0)
    assert found is not None and found[:2] == (list(range(20)), 30)
    assert SlotFiles(tmp_path, cache, "f16", "m").save(0, "s0.bin").n_tokens == 20
    target = PromptCache()
    assert SlotFiles(tmp_path, target, "f16", "m").restore(0, "s0.bin").n_tokens == 20
    assert target.lookup(list(range(28)))[1] == 20
    restored = target.slot_entry(0)
    assert restored is not None and restored[1] == 20
    assert mx.array_equal(restored[2][0].keys, rows[:, :, :20].astype(mx.float16))
