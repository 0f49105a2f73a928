"""/v1/images/generations and /v1/images/edits through a real `mlxcel serve --image-model`.

The server runs a tiny random-weight Z-Image pipeline (tests/fixtures/tiny_image.py); the
official openai SDK and httpx talk to it on 127.0.0.1.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("mflux", reason="image generation needs the image extra (mflux)")

from fixtures.tiny_image import png_size, subprocess_env, tiny_pipeline_dir
from server_harness import API_KEY, AUTH, ServeProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def z_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "z-image")


@pytest.fixture(scope="module")
def server(z_dir: Any) -> Iterator[ServeProcess]:
    args = ["--image-model", str(z_dir), "--api-key", API_KEY]
    with ServeProcess(args, env=subprocess_env()) as proc:
        yield proc


def _sdk(server: ServeProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _generate(server: ServeProcess, **body: Any) -> httpx.Response:
    with server.client(headers=AUTH, timeout=300) as client:
        return client.post("/v1/images/generations", json={"prompt": "a red cat", **body})


def test_sdk_generate_png_of_the_size_and_seed_plus_i(server: ServeProcess) -> None:
    result = _sdk(server).images.generate(
        prompt="a red cat", size="32x16", n=2, response_format="b64_json",
        extra_body={"seed": 7, "steps": 2},
    )  # fmt: skip
    pictures = [base64.b64decode(item.b64_json) for item in result.data]
    assert [png_size(p) for p in pictures] == [(32, 16), (32, 16)]
    assert pictures[0] != pictures[1]
    shape = result.model_dump()
    assert shape["output_format"] == "png" and shape["size"] == "32x16"
    first = shape["data"][0]
    assert (first["mime_type"], first["width"], first["height"], first["seed"]) == (
        "image/png", 32, 16, 7,
    )  # fmt: skip
    assert first["revised_prompt"] == "a red cat"
    assert isinstance(shape["created"], int)
    # the same seed gives the same bytes; seed 8 alone is the second image above
    alone = _generate(server, size="32x16", seed=8, steps=2).json()
    assert base64.b64decode(alone["data"][0]["b64_json"]) == pictures[1]
    other = _generate(server, size="32x16", seed=9, steps=2).json()
    assert base64.b64decode(other["data"][0]["b64_json"]) not in pictures


def test_alias_route_and_img2img_edit_as_json(server: ServeProcess) -> None:
    with server.client(headers=AUTH, timeout=300) as client:
        made = client.post(
            "/images/generations", json={"prompt": "a cat", "size": "16x16", "seed": 1, "steps": 2}
        )
        assert made.status_code == 200, made.text
        source = base64.b64decode(made.json()["data"][0]["b64_json"])
        for body in (
            {"image": _data_uri(source)},
            {"images": [{"image_url": _data_uri(source)}]},
            {"image": base64.b64encode(source).decode()},
        ):
            edited = client.post(
                "/v1/images/edits",
                json={"prompt": "a dog", "size": "16x32", "seed": 2, "steps": 4,
                      "strength": 0.5, **body},
            )  # fmt: skip
            assert edited.status_code == 200, edited.text
            picture = base64.b64decode(edited.json()["data"][0]["b64_json"])
            assert png_size(picture) == (16, 32)
        alias = client.post(
            "/images/edits", json={"prompt": "a dog", "size": "16x16", "steps": 1,
                                   "image": _data_uri(source)},
        )  # fmt: skip
        assert alias.status_code == 200, alias.text


def test_sdk_multipart_edit_gets_415_naming_the_json_form(
    server: ServeProcess, tmp_path: Any
) -> None:
    source = base64.b64decode(
        _generate(server, size="16x16", steps=1).json()["data"][0]["b64_json"]
    )
    path = tmp_path / "in.png"
    path.write_bytes(source)
    with pytest.raises(openai.APIStatusError) as caught, path.open("rb") as handle:
        _sdk(server).images.edit(image=handle, prompt="a dog")
    assert caught.value.status_code == 415
    error = caught.value.body
    assert "JSON" in error["message"] and "image_url" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"size": "30x16"}, "multiple of 16"),
        ({"size": "huge"}, "WIDTHxHEIGHT"),
        ({"response_format": "url"}, "only b64_json"),
        ({"output_format": "jpeg"}, "only png"),
        ({"url": "http://x"}, "does not write files"),
        ({"output_dir": "/tmp"}, "does not write files"),
        ({"path": "/tmp/x.png"}, "does not write files"),
        ({"n": 0}, "n"),
        ({"prompt": ""}, "prompt"),
        ({"background": "transparent"}, "background"),
    ],
)
def test_generation_400s(server: ServeProcess, body: dict[str, Any], needle: str) -> None:
    response = _generate(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({}, "needs an input picture"),
        ({"image": "data:image/png;base64,@@@"}, "not valid base64"),
        ({"image": base64.b64encode(b"not a picture").decode()}, "not a readable image"),
        ({"image": "https://example.com/cat.png"}, "does not fetch URLs"),
        ({"images": [{"file_id": "file-1"}]}, "file_id"),
        ({"image": "AAAA", "mask": "AAAA"}, "mask"),
    ],
)
def test_edit_400s(server: ServeProcess, body: dict[str, Any], needle: str) -> None:
    with server.client(headers=AUTH) as client:
        response = client.post("/v1/images/edits", json={"prompt": "a dog", **body})
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_bad_json_and_chat_routes_on_an_image_only_server(server: ServeProcess) -> None:
    with server.client(headers=AUTH) as client:
        broken = client.post(
            "/v1/images/generations",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
        assert broken.status_code == 400
        chat = client.post("/v1/chat/completions", json={"messages": []})
        assert chat.status_code == 501
        assert "/v1/images/generations" in chat.json()["error"]["message"]


def test_routes_answer_501_naming_the_flag_without_an_image_model() -> None:
    from starlette.testclient import TestClient

    from mlxcel.config.settings import Settings
    from mlxcel.server.app import create_app
    from mlxcel.server.state import ServerState

    state = ServerState(settings=Settings(warmup=False), text_engine=False)
    with TestClient(create_app(state)) as client:
        for path in ("/v1/images/generations", "/images/generations", "/v1/images/edits",
                     "/images/edits"):  # fmt: skip
            response = client.post(path, json={"prompt": "x"})
            assert response.status_code == 501, path
            error = response.json()["error"]
            assert error["type"] == "not_implemented" and "--image-model" in error["message"]


def test_full_queue_503_before_work_and_timeout_504(z_dir: Any) -> None:
    args = ["--image-model", str(z_dir), "--image-queue-depth", "1", "--image-timeout", "8"]
    with ServeProcess(args, env=subprocess_env()) as proc:
        long = {"prompt": "x", "size": "64x64", "steps": 200, "n": 10}
        answers: list[httpx.Response] = []

        def post() -> None:
            with proc.client(timeout=120) as client:
                answers.append(client.post("/v1/images/generations", json=long))

        # one runs, one waits in the queue of depth 1, one finds it full: whatever the order
        threads = [threading.Thread(target=post) for _ in range(3)]
        for thread in threads:
            thread.start()
            time.sleep(0.5)
        for thread in threads:
            thread.join(120)
        statuses = sorted(answer.status_code for answer in answers)
        assert statuses == [503, 504, 504], [a.text for a in answers]
        busy = next(a for a in answers if a.status_code == 503)
        assert busy.json()["error"]["type"] == "server_busy"
        assert busy.headers.get("retry-after") == "1"
        for answer in answers:
            if answer.status_code == 504:
                assert answer.json()["error"]["type"] == "timeout_error"
        with proc.client(timeout=120) as client:  # the worker serves again afterwards
            after = client.post(
                "/v1/images/generations", json={"prompt": "x", "size": "16x16", "steps": 1}
            )
        assert after.status_code == 200, after.text
