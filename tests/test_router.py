"""Router mode end to end: `mlxcel serve --models-dir DIR` with three tiny models.

The directory holds an MLX chat model (`chat-a`), a GGUF chat model (`chat-b.gguf`) and a
BERT embedding model (`embed`); every server here is a real `mlxcel serve` subprocess.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.haproxy import free_port
from server_harness import ServeProcess

CHAT = [{"role": "user", "content": "Hello"}]
MODELS = ("chat-a", "chat-b", "embed")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """chat-a (MLX llama directory), chat-b.gguf (Q8_0 llama) and embed (BERT directory)."""
    from fixtures.tiny_encoders import build_tiny_bert
    from fixtures.tiny_models import build_tiny_model, write_tiny_gguf

    root = tmp_path_factory.mktemp("router-models")
    build_tiny_model(root / "chat-a", "llama")
    source = build_tiny_model(tmp_path_factory.mktemp("router-src") / "b", "llama", seed=1)
    write_tiny_gguf(source, root / "chat-b.gguf", "Q8_0")
    build_tiny_bert(root / "embed")
    (root / "notes.txt").write_text("not a model")
    return root


def serve(models_dir: Path, *extra: str, env: dict[str, str] | None = None) -> ServeProcess:
    args = ["--models-dir", str(models_dir), "-c", "512", "-np", "2", "--metrics", *extra]
    return ServeProcess(args, env=env).start()


@pytest.fixture(scope="module")
def router(models_dir: Path) -> Iterator[ServeProcess]:
    server = serve(models_dir)
    try:
        yield server
    finally:
        server.stop()


def statuses(client: httpx.Client) -> dict[str, str]:
    body = client.get("/models").json()
    return {m["id"]: m["status"]["value"] for m in body["data"]}


def chat(client: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def wait_status(client: httpx.Client, model: str, wanted: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while statuses(client)[model] != wanted:
        assert time.monotonic() < deadline, f"{model} never became {wanted}: {statuses(client)}"
        time.sleep(0.05)


# ------------------------------------------------------------------------ listing


def test_every_model_of_the_directory_is_listed(router: ServeProcess) -> None:
    with router.client() as client:
        for path in ("/models", "/v1/models"):
            body = client.get(path).json()
            assert body["object"] == "list"
            ids = [m["id"] for m in body["data"]]
            assert ids == ["chat-a", "chat-b", "embed"]  # named as llama-server names them
            kinds = {m["id"]: m["kind"] for m in body["data"]}
            assert kinds == {"chat-a": "text", "chat-b": "text", "embed": "embedding"}
        one = client.get("/v1/models/chat-b").json()
        assert one["id"] == "chat-b" and one["path"].endswith("chat-b.gguf")
        assert client.get("/v1/models/nope").status_code == 404


def test_router_props_and_health(router: ServeProcess) -> None:
    with router.client() as client:
        props = client.get("/props").json()
        assert props["role"] == "router" and props["max_instances"] == 4
        assert props["models_autoload"] is True
        assert client.get("/health").json() == {"status": "ok"}


# ------------------------------------------------------------------------ routing


def test_a_request_loads_its_model_on_demand(router: ServeProcess) -> None:
    with router.client() as client:
        first = chat(client, "chat-a")
        assert first.status_code == 200, first.text
        assert first.json()["model"] == "chat-a"
        assert statuses(client)["chat-a"] == "loaded"
        # GET routes name their model in ?model=
        props = client.get("/props", params={"model": "chat-a"}).json()
        assert props["model_alias"] == "chat-a"
        slots = client.get("/slots", params={"model": "chat-a"}).json()
        assert len(slots) == 2
        metrics = client.get("/metrics", params={"model": "chat-a"})
        assert metrics.status_code == 200 and "llamacpp:prompt_tokens_total" in metrics.text
        stream = client.post(
            "/v1/completions",
            json={"model": "chat-a", "prompt": "Hi", "max_tokens": 3, "stream": True},
        )
        assert stream.status_code == 200 and "data: [DONE]" in stream.text


def test_model_events_stream_status_changes(router: ServeProcess) -> None:
    import json

    events: list[dict[str, Any]] = []
    connected = threading.Event()

    def listen() -> None:
        with (
            httpx.Client(base_url=router.url, timeout=60) as client,
            client.stream("GET", "/models/sse") as response,
        ):
            assert response.headers["content-type"].startswith("text/event-stream")
            connected.set()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1].get("data", {}).get("status") == "unloaded":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert connected.wait(30)
    time.sleep(0.3)
    with router.client() as client:
        if statuses(client)["chat-b"] != "unloaded":
            client.post("/models/unload", json={"model": "chat-b"})
            time.sleep(0.5)
            events.clear()
        assert client.post("/models/load", json={"model": "chat-b"}).status_code == 200
        time.sleep(0.3)
        assert client.post("/models/unload", json={"model": "chat-b"}).status_code == 200
    listener.join(30)
    mine = [e["data"]["status"] for e in events if e["model"] == "chat-b"]
    assert mine[-2:] == ["loaded", "unloaded"], events
    assert all(e["event"] == "model_status" for e in events), events


def test_unknown_and_missing_model_are_refused_naming_the_models(router: ServeProcess) -> None:
    with router.client() as client:
        response = chat(client, "no-such-model")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
        for name in ("chat-a", "chat-b", "embed"):
            assert name in error["message"]
        missing = client.post("/v1/chat/completions", json={"messages": CHAT})
        assert missing.status_code == 400 and "model" in missing.json()["error"]["message"]
        assert client.get("/slots").status_code == 400  # a GET needs ?model= too
        bad = client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 400 and "error" in bad.json()


def test_a_request_the_model_cannot_serve_is_a_400(router: ServeProcess) -> None:
    with router.client() as client:
        refused = chat(client, "embed")
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "model_not_supported"
        assert "chat-a" in refused.json()["error"]["message"]  # who can
        assert statuses(client)["embed"] == "unloaded"  # refused before loading
        wrong = client.post("/v1/embeddings", json={"model": "chat-b", "input": "hello"})
        assert wrong.status_code == 400
        ok = client.post("/v1/embeddings", json={"model": "embed", "input": ["hello", "world"]})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["data"]) == 2 and ok.json()["model"] == "embed"
        ranked = client.post(
            "/v1/rerank", json={"model": "embed", "query": "hello", "documents": ["a", "hello"]}
        )
        assert ranked.status_code == 200, ranked.text


def test_explicit_load_and_unload(router: ServeProcess) -> None:
    with router.client() as client:
        if statuses(client)["chat-b"] != "unloaded":
            client.post("/models/unload", json={"model": "chat-b"})
            wait_status(client, "chat-b", "unloaded")
        loaded = client.post("/models/load", json={"model": "chat-b"})
        assert loaded.status_code == 200 and loaded.json() == {"success": True}
        assert statuses(client)["chat-b"] == "loaded"
        again = client.post("/models/load", json={"model": "chat-b"})
        assert again.status_code == 400
        assert chat(client, "chat-b").status_code == 200
        unloaded = client.post("/models/unload", json={"model": "chat-b"})
        assert unloaded.status_code == 200 and unloaded.json() == {"success": True}
        assert statuses(client)["chat-b"] == "unloaded"
        assert client.post("/models/unload", json={"model": "chat-b"}).status_code == 400
        unknown = client.post("/models/load", json={"model": "zzz"})
        assert unknown.status_code == 400 and "chat-a" in unknown.json()["error"]["message"]
        # ?autoload=false refuses instead of loading
        response = client.post(
            "/v1/chat/completions?autoload=false",
            json={"model": "chat-b", "messages": CHAT, "max_tokens": 2},
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "model_not_loaded"
        assert statuses(client)["chat-b"] == "unloaded"


def test_the_openai_sdk_switches_models(router: ServeProcess) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    ids = {m.id for m in client.models.list()}
    assert ids == {"chat-a", "chat-b", "embed"}
    for model in ("chat-a", "chat-b", "chat-a"):
        answer = client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=3,
            temperature=0,  # type: ignore[arg-type]
        )
        assert answer.model == model and answer.choices[0].message.content is not None
    vectors = client.embeddings.create(model="embed", input="hello")
    assert vectors.model == "embed" and len(vectors.data[0].embedding) > 0
    streamed = client.chat.completions.create(
        model="chat-b",
        messages=CHAT,
        max_tokens=3,
        stream=True,  # type: ignore[arg-type]
    )
    assert {chunk.model for chunk in streamed} == {"chat-b"}
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)  # type: ignore[arg-type]
    assert "chat-a" in str(caught.value)


def test_the_anthropic_sdk_lists_and_uses_the_models(router: ServeProcess) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["chat-a", "chat-b", "embed"]
    assert client.models.retrieve("chat-b").id == "chat-b"
    message = client.messages.create(
        model="chat-b", max_tokens=3, messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.type == "message" and message.content
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
        )
    assert "chat-a" in str(caught.value)
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("claude-x")


def test_mlxcel_bench_serve_measures_a_routed_model(router: ServeProcess) -> None:
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable, "-m", "mlxcel", "bench", "serve", "--url", router.url,
            "-m", "chat-b", "-c", "1,2", "--requests", "4", "--prompt-len", "8", "-n", "4",
            "--json",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["model"] == "chat-b"
    assert all(level["errors"] == 0 for level in report["levels"]), report


def test_requests_flow_to_two_models_while_a_third_loads(
    models_dir: Path, smollm2_gguf: Path, tmp_path: Path
) -> None:
    """SmolLM2 (135M, converted from GGUF on its first load) takes seconds to load: the
    loaded models answer meanwhile, and a request for SmolLM2 waits for its load."""
    root = tmp_path / "models"
    root.mkdir()
    for item in models_dir.iterdir():
        (root / item.name).symlink_to(item)
    (root / "smollm2.gguf").symlink_to(smollm2_gguf)
    server = serve(root, env={"MLXCEL_MODEL_STORE": str(tmp_path / "store")})
    try:
        with server.client(timeout=300) as client:
            assert chat(client, "chat-a").status_code == 200
            embed = {"model": "embed", "input": "hi"}
            assert client.post("/v1/embeddings", json=embed).status_code == 200
            waiting: list[httpx.Response] = []

            def wait_for_smollm2() -> None:
                with server.client(timeout=300) as own:
                    waiting.append(chat(own, "smollm2"))

            waiter = threading.Thread(target=wait_for_smollm2, daemon=True)
            waiter.start()
            wait_status(client, "smollm2", "loading")
            served_during_load = 0
            while statuses(client)["smollm2"] == "loading":
                assert chat(client, "chat-a").status_code == 200
                assert client.post("/v1/embeddings", json=embed).status_code == 200
                served_during_load += 1
            waiter.join(300)
            assert served_during_load >= 2, served_during_load
            assert waiting and waiting[0].status_code == 200, waiting
            assert waiting[0].json()["model"] == "smollm2"
    finally:
        server.stop()


# ------------------------------------------------------------------------ limits


def test_models_max_1_unloads_the_least_recently_used(models_dir: Path) -> None:
    server = serve(models_dir, "--models-max", "1")
    try:
        with server.client() as client:
            assert chat(client, "chat-a").status_code == 200
            assert statuses(client) == {
                "chat-a": "loaded",
                "chat-b": "unloaded",
                "embed": "unloaded",
            }
            assert chat(client, "chat-b").status_code == 200
            assert statuses(client) == {
                "chat-a": "unloaded",
                "chat-b": "loaded",
                "embed": "unloaded",
            }
            emb = client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
            assert emb.status_code == 200
            assert statuses(client) == {
                "chat-a": "unloaded",
                "chat-b": "unloaded",
                "embed": "loaded",
            }
            assert "unloading chat-a (least recently used)" in server.stderr
    finally:
        server.stop()


def test_no_models_autoload(models_dir: Path) -> None:
    server = serve(models_dir, "--no-models-autoload")
    try:
        with server.client() as client:
            refused = chat(client, "chat-a")
            assert refused.status_code == 400 and "not loaded" in refused.json()["error"]["message"]
            assert statuses(client)["chat-a"] == "unloaded"
            assert client.post("/models/load", json={"model": "chat-a"}).status_code == 200
            assert chat(client, "chat-a").status_code == 200
            # ?autoload=true loads anyway
            forced = client.post(
                "/v1/chat/completions?autoload=true",
                json={"model": "chat-b", "messages": CHAT, "max_tokens": 2},
            )
            assert forced.status_code == 200
    finally:
        server.stop()


def test_a_load_that_does_not_fit_the_memory_budget_is_a_503(models_dir: Path) -> None:
    server = serve(models_dir, env={"MLXCEL_REQUEST_MEMORY_BUDGET": "64K"})
    try:
        with server.client() as client:
            response = chat(client, "chat-b")
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["type"] == "request_memory_budget_exceeded"
            assert error["budget_bytes"] == 64 * 1024
            assert error["estimated_bytes"] == (models_dir / "chat-b.gguf").stat().st_size
            assert statuses(client)["chat-b"] == "unloaded"
    finally:
        server.stop()


def test_the_metrics_port_labels_each_model_and_counts_the_router(models_dir: Path) -> None:
    """`--metrics-port` serves every loaded model's families labelled model="NAME" plus the
    router's own; the main port's `/metrics` stays llama-server's (`?model=`, unlabelled)."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    server = serve(models_dir, "--metrics-port", str(port), "--models-max", "2")

    def scrape() -> dict[tuple[str, str | None], float]:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert response.status_code == 200, response.text
        return {
            (sample.name, sample.labels.get("model")): sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        }

    try:
        with server.client() as client:
            assert chat(client, "chat-a").status_code == 200
            for _ in range(2):
                assert chat(client, "chat-b").status_code == 200
            # at --models-max 2 this evicts chat-a, the least recently used
            emb = client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
            assert emb.status_code == 200, emb.text
            samples = scrape()
            assert samples["mlxcel_requests_total", "chat-b"] == 2
            assert samples["llamacpp:tokens_predicted_total", "chat-b"] > 0
            assert ("mlxcel_requests_total", "chat-a") not in samples  # unloaded: no series
            assert ("mlxcel_slots_total", "embed") in samples
            loaded = {name: samples["mlxcel_router_model_loaded", name] for name in MODELS}
            assert loaded == {"chat-a": 0, "chat-b": 1, "embed": 1}
            assert samples["mlxcel_router_models", None] == 3
            assert samples["mlxcel_router_models_loaded", None] == 2
            assert samples["mlxcel_router_loads_total", None] == 3
            assert samples["mlxcel_router_evictions_total", None] == 1
            assert samples["mlxcel_router_unloads_total", None] == 0
            one = client.get("/metrics", params={"model": "chat-b"})
            assert one.status_code == 200 and "\nmlxcel_requests_total 2\n" in one.text
            assert client.get("/metrics").status_code == 400  # as llama-server's router
            unload = client.post("/models/unload", json={"model": "chat-b"})
            assert unload.status_code == 200
            samples = scrape()
            assert samples["mlxcel_router_unloads_total", None] == 1
            assert samples["mlxcel_router_model_loaded", "chat-b"] == 0
            assert ("mlxcel_requests_total", "chat-b") not in samples
    finally:
        server.stop()


# ------------------------------------------------------------------------ presets


def test_preset_defaults_sections_aliases_pin_and_load_on_startup(
    models_dir: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    preset = tmp_path / "models.ini"
    preset.write_text(
        "version = 1\n"
        "[*]\n"
        "c = 256\n"
        "np = 3\n"
        "[chat-a]\n"
        "pin = true\n"
        "load-on-startup = true\n"
        "alias = assistant\n"
        "[extra]\n"
        f"model = {tiny_gguf}\n"
        "LLAMA_ARG_CTX_SIZE = 128\n"
    )
    args = ["--models-dir", str(models_dir), "--models-preset", str(preset), "--models-max", "2"]
    server = ServeProcess([*args, "-np", "2"]).start()
    try:
        with server.client() as client:
            wait_status(client, "chat-a", "loaded")  # load-on-startup
            listed = {m["id"]: m for m in client.get("/models").json()["data"]}
            assert set(listed) == {"chat-a", "chat-b", "embed", "extra"}
            assert listed["chat-a"]["aliases"] == ["assistant"] and listed["chat-a"]["pinned"]
            assert listed["extra"]["source"] == "preset"
            assert chat(client, "assistant").status_code == 200  # chat-a by its alias
            # [*] c = 256 split over the command line's -np 2 (which wins over np = 3)
            props = client.get("/props", params={"model": "chat-a"}).json()
            assert props["default_generation_settings"]["n_ctx"] == 128
            assert len(client.get("/slots", params={"model": "chat-a"}).json()) == 2
            assert chat(client, "extra").status_code == 200  # its own section: -c 128
            extra = client.get("/props", params={"model": "extra"}).json()
            assert extra["default_generation_settings"]["n_ctx"] == 64
            # --models-max 2: chat-a is pinned, so the least recently used other model goes
            assert chat(client, "chat-b").status_code == 200
            assert statuses(client) == {
                "chat-a": "loaded", "chat-b": "loaded", "embed": "unloaded", "extra": "unloaded"
            }  # fmt: skip
            emb = client.post("/v1/embeddings", json={"model": "embed", "input": "x"})
            assert emb.status_code == 200
            assert statuses(client) == {
                "chat-a": "loaded", "chat-b": "unloaded", "embed": "loaded", "extra": "unloaded"
            }  # fmt: skip
    finally:
        server.stop()


@pytest.mark.parametrize(
    "case",
    ["bad-option", "missing-dir", "with-m", "no-model-in-section"],
)
def test_bad_presets_and_flags_refuse_to_start(case: str, models_dir: Path, tmp_path: Path) -> None:
    preset = tmp_path / "bad.ini"
    preset.write_text(
        "[chat-a]\nno-such-option = 3\n" if case == "bad-option" else "[ghost]\nc = 64\n"
    )
    args = {
        "bad-option": ["--models-dir", str(models_dir), "--models-preset", str(preset)],
        "missing-dir": ["--models-dir", str(tmp_path / "missing")],
        "with-m": ["--models-dir", str(models_dir), "-m", str(models_dir / "chat-a")],
        "no-model-in-section": ["--models-dir", str(models_dir), "--models-preset", str(preset)],
    }[case]
    server = ServeProcess(args)
    with pytest.raises(RuntimeError, match="exited early"):
        server.start(timeout=60)
    assert server.proc is not None and server.proc.returncode == 2
    lines = server.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), server.stderr
    expected = {
        "bad-option": "no-such-option",
        "missing-dir": "no such directory",
        "with-m": "drop -m",
        "no-model-in-section": "[ghost]",
    }[case]
    assert expected in lines[0]


def test_a_model_sleeps_when_idle_and_wakes_on_its_next_request(
    models_dir: Path, tmp_path: Path
) -> None:
    preset = tmp_path / "sleepy.ini"
    preset.write_text("[chat-a]\nsleep-idle-seconds = 1\n")
    server = serve(models_dir, "--models-preset", str(preset))
    try:
        with server.client() as client:
            assert chat(client, "chat-a").status_code == 200
            assert chat(client, "chat-b").status_code == 200
            wait_status(client, "chat-a", "sleeping", timeout=30)
            assert statuses(client)["chat-b"] == "loaded"  # only chat-a's preset sleeps
            props = client.get("/props", params={"model": "chat-a"}).json()
            assert props["is_sleeping"] is True  # /props leaves it asleep
            assert chat(client, "chat-a").status_code == 200  # wakes it
            assert statuses(client)["chat-a"] in ("loaded", "sleeping")
            assert "chat-a" in server.stderr
    finally:
        server.stop()


def test_a_vision_model_is_routed_with_its_images(models_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")
    import base64
    import io

    from fixtures.tiny_vlm import build_tiny_qwen2_vl
    from PIL import Image

    root = tmp_path / "models"
    root.mkdir()
    (root / "chat-a").symlink_to(models_dir / "chat-a")
    build_tiny_qwen2_vl(root / "qwen2-vl")
    picture = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(picture, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    message = [
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ]}
    ]  # fmt: skip
    env = {"HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}
    server = serve(root, env=env)
    try:
        with server.client() as client:
            listed = {m["id"]: m for m in client.get("/models").json()["data"]}
            assert listed["qwen2-vl"]["kind"] == "vision"
            assert listed["qwen2-vl"]["architecture"]["input_modalities"] == ["text", "image"]
            body = {"model": "qwen2-vl", "messages": message, "max_tokens": 3}
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] > 20  # the image's patch tokens
            props = client.get("/props", params={"model": "qwen2-vl"}).json()
            assert props["modalities"]["vision"] is True
            # the text model of the same router refuses the image, as a single server does
            assert chat(client, "chat-a", messages=message).status_code == 400
    finally:
        server.stop()


def test_whisper_tts_and_image_models_are_routed(
    models_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Uploads name their model in the form (as the openai SDK sends it), JSON bodies in
    `model`; each goes to its own worker, and a route another kind of model serves is a 400."""
    pytest.importorskip("mflux", reason="image generation needs the image extra (mflux)")
    from fixtures.audio import speech_wav, tiny_kokoro_dir, tiny_whisper_dir
    from fixtures.tiny_image import png_size, subprocess_env, tiny_pipeline_dir
    from openai import BadRequestError, OpenAI

    root = tmp_path / "models"
    root.mkdir()
    (root / "chat-a").symlink_to(models_dir / "chat-a")
    (root / "whisper").symlink_to(tiny_whisper_dir())
    (root / "kokoro").symlink_to(tiny_kokoro_dir())
    (root / "z-image").symlink_to(tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "z-image"))
    server = serve(root, env=subprocess_env())
    try:
        with server.client() as client:
            kinds = {m["id"]: m["kind"] for m in client.get("/models").json()["data"]}
        assert kinds == {
            "chat-a": "text", "kokoro": "speech", "whisper": "transcription", "z-image": "image"
        }  # fmt: skip
        sdk = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        wav = speech_wav().read_bytes()
        text = sdk.audio.transcriptions.create(model="whisper", file=("speech.wav", wav))
        assert isinstance(text.text, str)
        audio = sdk.audio.speech.create(
            model="kokoro", voice="alloy", input="[[hˈI]]", response_format="wav"
        )
        assert audio.content[:4] == b"RIFF" and len(audio.content) > 44
        picture = sdk.images.generate(
            model="z-image", prompt="a red cat", size="32x16", response_format="b64_json",
            extra_body={"seed": 7, "steps": 2},
        )  # fmt: skip
        import base64

        assert png_size(base64.b64decode(str(picture.data[0].b64_json))) == (32, 16)
        with pytest.raises(BadRequestError, match="cannot serve transcriptions"):
            sdk.audio.transcriptions.create(model="chat-a", file=("speech.wav", wav))
        with pytest.raises(BadRequestError, match="kokoro"):  # names who can
            sdk.audio.speech.create(model="whisper", voice="alloy", input="hi")
        with pytest.raises(BadRequestError, match="cannot serve chat"):
            sdk.chat.completions.create(model="z-image", messages=CHAT)  # type: ignore[arg-type]
    finally:
        server.stop()


def _realtime_refusal(url: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body that refuse a `/v1/realtime` upgrade at `url`."""
    import asyncio
    import json

    import websockets

    async def refused() -> tuple[int, dict[str, Any]]:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(url):
                pass
        response = info.value.response
        return int(response.status_code), json.loads(response.body or b"{}")

    return asyncio.run(refused())


def test_realtime_without_whisper_and_kokoro_names_what_is_missing(router: ServeProcess) -> None:
    from realtime_client import ws_url

    status, body = _realtime_refusal(ws_url(router.url, "/v1/realtime?model=chat-a"))
    assert status == 501 and body["error"]["type"] == "not_implemented"
    message = body["error"]["message"]
    assert "no speech-to-text model" in message and "text-to-speech model" in message
    status, body = _realtime_refusal(ws_url(router.url, "/v1/realtime?model=nope"))
    assert status == 400 and body["error"]["code"] == "model_not_found"


def test_realtime_session_runs_on_a_routed_chat_whisper_and_kokoro(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    """`?model=` picks the chat model; the router's Whisper transcribes and its Kokoro
    speaks, each loaded on demand and held while the session lasts."""
    import asyncio

    from fixtures.audio import (
        SENTENCE,
        normalized_words,
        require_shipped_whisper,
        tiny_kokoro_dir,
    )
    from realtime_client import Client, connect, speech_pcm, ws_url

    whisper = require_shipped_whisper()
    root = tmp_path / "models"
    root.mkdir()
    (root / "smol.gguf").symlink_to(smollm2_gguf)
    (root / "whisper").symlink_to(whisper)
    (root / "kokoro").symlink_to(tiny_kokoro_dir())
    server = ServeProcess(
        ["--models-dir", str(root), "-c", "2048", "--temp", "0", "--models-max", "3"]
    ).start()
    manual = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}

    async def scenario() -> Client:
        async with connect(ws_url(server.url, "/v1/realtime?model=smol"), None) as ws:
            client = Client(ws)
            await client.until("session.created")
            await client.send("session.update", session={**manual, "max_output_tokens": 16})
            await client.until("session.updated")
            await client.speak(speech_pcm())
            await client.send("input_audio_buffer.commit")
            await client.send("response.create")
            await client.until("response.done")
            with server.client() as http:  # all three stay loaded while the session lasts
                assert statuses(http) == {"kokoro": "loaded", "smol": "loaded", "whisper": "loaded"}
                unload = http.post("/models/unload", json={"model": "kokoro"})
                assert unload.status_code == 200
                # no new request goes to it; it stops once the session ends (or stop-timeout)
                assert statuses(http)["kokoro"] == "unloaded"
            return client

    try:
        client = asyncio.run(scenario())
        with server.client() as http:
            wrong = _realtime_refusal(ws_url(server.url, "/v1/realtime?model=kokoro"))
            assert wrong[0] == 400 and wrong[1]["error"]["code"] == "model_not_supported"
            assert http.get("/health").status_code == 200
    finally:
        server.stop()
    completed = client.of("conversation.item.input_audio_transcription.completed")
    assert normalized_words(completed[0]["transcript"]) == normalized_words(SENTENCE)
    done = client.of("response.done")[0]["response"]
    assert done["status"] in ("completed", "incomplete")
    assert done["usage"]["output_tokens"] > 0
    audio = b"".join(base64.b64decode(e["delta"]) for e in client.of("response.output_audio.delta"))
    assert len(audio) > 0
    assert client.of("session.created")[0]["session"]["model"] == "smol"


def test_api_keys_guard_the_router_before_any_load(models_dir: Path) -> None:
    from realtime_client import ws_url

    server = serve(models_dir, "--api-key", "sk-router")
    try:
        with server.client() as client:
            refused = chat(client, "chat-a")
            assert refused.status_code == 401
            assert client.post("/models/load", json={"model": "chat-a"}).status_code == 401
            assert client.get("/models").status_code == 200  # keyless, as llama-server
            status, body = _realtime_refusal(ws_url(server.url, "/v1/realtime?model=chat-a"))
            assert status == 401 and body["error"]["type"] == "missing_api_key"
            assert statuses(client)["chat-a"] == "unloaded"
            auth = {"Authorization": "Bearer sk-router"}
            ok = client.post(
                "/v1/chat/completions",
                headers=auth,
                json={"model": "chat-a", "messages": CHAT, "max_tokens": 2},
            )
            assert ok.status_code == 200
    finally:
        server.stop()


def test_sigterm_drains_the_requests_of_every_model(models_dir: Path) -> None:
    import contextlib
    import json
    import signal

    server = serve(models_dir, "--no-warmup")
    results: list[tuple[int, int]] = []
    started = threading.Event()

    def stream(model: str) -> None:
        body = {"model": model, "prompt": "Once", "n_predict": 48, "stream": True}
        body["ignore_eos"] = True
        with (
            httpx.Client(base_url=server.url, timeout=120) as client,
            client.stream("POST", "/completion", json=body) as response,
        ):
            predicted = -1
            for line in response.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    started.set()
                    if event.get("stop"):
                        predicted = int(event.get("tokens_predicted", -1))
            results.append((response.status_code, predicted))

    try:
        threads = [threading.Thread(target=stream, args=(m,)) for m in ("chat-a", "chat-b")]
        for thread in threads:
            thread.start()
        assert started.wait(60), server.stderr
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        health: list[int] = []
        while any(t.is_alive() for t in threads):
            with contextlib.suppress(httpx.HTTPError):
                health.append(httpx.get(f"{server.url}/health", timeout=2).status_code)
            time.sleep(0.05)
        for thread in threads:
            thread.join(30)
        code = server.wait_exit(30)
    finally:
        server.stop()
    assert code == 0, server.stderr
    assert sorted(results) == [(200, 48), (200, 48)], results
    assert 503 in health  # draining while they finished
    assert "Traceback" not in server.stderr


def test_hostile_requests_and_a_broken_model_get_one_line_answers(
    models_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "chat-a").symlink_to(models_dir / "chat-a")
    (root / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    server = serve(root)
    try:
        assert "broken" in server.stderr  # warned at start, still listed
        with server.client() as client:
            assert [m["id"] for m in client.get("/models").json()["data"]] == ["broken", "chat-a"]
            failed = chat(client, "broken")
            assert failed.status_code == 500 and "broken" in failed.json()["error"]["message"]
            listed = {m["id"]: m["status"] for m in client.get("/models").json()["data"]}
            assert listed["broken"] == {**listed["broken"], "value": "unloaded", "failed": True}
            for body in ({"model": ["chat-a"]}, {"model": 7}, ["chat-a"], "chat-a"):
                response = client.post("/v1/chat/completions", json=body)
                assert response.status_code == 400, (body, response.text)
            deep = b'{"model": "chat-a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
            nested = client.post(
                "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
            )
            assert nested.status_code == 400
            lone = b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
            surrogate = client.post(
                "/v1/chat/completions", content=lone, headers={"content-type": "application/json"}
            )
            assert surrogate.status_code == 400, surrogate.text
            assert surrogate.json()["error"]["type"] == "invalid_request_error"
            assert client.get("/props?model=%ed%a0%80").status_code == 400  # a surrogate, UTF-8
            odd = client.get("/slots?model=%ff%fe%00")
            assert odd.status_code == 400 and odd.json()["error"]["code"] == "model_not_found"
            long_name = chat(client, "x" * 20000)
            assert long_name.status_code in (400, 413)
            assert len(long_name.text) < 2000
            assert chat(client, "chat-a").status_code == 200  # still serving
    finally:
        server.stop()
    assert "Traceback" not in server.stderr


def test_models_reload_reads_the_directory_again(models_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "chat-a").symlink_to(models_dir / "chat-a")
    server = serve(root)
    try:
        with server.client() as client:
            assert chat(client, "chat-a").status_code == 200
            (root / "chat-b.gguf").symlink_to(models_dir / "chat-b.gguf")
            assert list(statuses(client)) == ["chat-a"]  # not read again without ?reload
            (root / "chat-a").unlink()
            body = client.get("/models", params={"reload": "1"}).json()
            assert [m["id"] for m in body["data"]] == ["chat-b"]
            assert chat(client, "chat-a").status_code == 400
            assert chat(client, "chat-b").status_code == 200
            (root / "embed").symlink_to(models_dir / "embed")
            assert client.post("/models/reload").json() == {"success": True}
            assert list(statuses(client)) == ["chat-b", "embed"]
    finally:
        server.stop()


def test_mlxcel_cache_stats_and_reset_name_a_routed_model(router: ServeProcess) -> None:
    """`mlxcel cache stats/reset -m NAME` reach that model's prompt cache; without a name the
    router answers 400 and the command says so in one line."""
    import json
    import subprocess
    import sys

    def cache(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "mlxcel", "cache", *args, "--url", router.url]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    with router.client(timeout=120) as client:
        assert chat(client, "chat-a").status_code == 200
    stats = cache("stats", "-m", "chat-a", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["entries"] >= 1
    reset = cache("reset", "--model", "chat-a", "--json")
    assert reset.returncode == 0, reset.stderr
    assert json.loads(reset.stdout)["freed_entries"] >= 1
    assert json.loads(cache("stats", "-m", "chat-a", "--json").stdout)["entries"] == 0
    unnamed = cache("stats")
    assert unnamed.returncode != 0
    assert len(unnamed.stderr.strip().splitlines()) == 1 and "400" in unnamed.stderr
