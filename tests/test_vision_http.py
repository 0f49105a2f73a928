"""Image, video and media-policy inputs through a real `mlxcel serve` on a tiny Qwen2-VL.

The official openai and anthropic SDKs talk to the server on 127.0.0.1. The media policy is
checked end to end: local files only under --media-path, remote URLs to a non-public address
(here loopback, which is never public) refused before any connection.
"""

from __future__ import annotations

import base64
import io
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")

from fixtures.tiny_vlm import build_tiny_qwen2_vl  # noqa: E402
from server_harness import API_KEY, AUTH, ServeProcess  # noqa: E402

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

ENV = {"HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}


def _png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    picture = Image.new("RGB", (64, 64), color)
    for x in range(0, 64, 8):
        for y in range(64):
            picture.putpixel((x, y), (255 - color[0], 255 - color[1], 255 - color[2]))
    out = io.BytesIO()
    picture.save(out, format="PNG")
    return out.getvalue()


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "green.png").write_bytes(_png((0, 200, 0)))
    (root.parent / "secret.png").write_bytes(_png((9, 9, 9)))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[ServeProcess]:
    model = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))
    args = ["-m", str(model), "--api-key", API_KEY, "-c", "2048", "--media-path", str(media_dir)]
    with ServeProcess(args, env=ENV) as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk(server: ServeProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _image_message(url: str, text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def _first_top(sdk: Any, url: str) -> list[tuple[str, float]]:
    result = sdk.chat.completions.create(
        model="m", messages=_image_message(url), max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=5,
    )  # fmt: skip
    first = result.choices[0].logprobs.content[0]
    return [(t.token, round(t.logprob, 4)) for t in first.top_logprobs]


def test_props_say_the_model_takes_images_and_video(server: ServeProcess) -> None:
    with server.client(headers=AUTH) as client:
        props = client.get("/props").json()
    assert props["modalities"] == {"vision": True, "video": True, "audio": False}


def test_an_image_changes_the_first_step_and_requests_are_deterministic(sdk: Any) -> None:
    red, blue = _uri(_png((250, 0, 0))), _uri(_png((0, 0, 250)))
    assert _first_top(sdk, red) != _first_top(sdk, blue)
    assert _first_top(sdk, red) == _first_top(sdk, red)
    usage = sdk.chat.completions.create(
        model="m", messages=_image_message(red), max_tokens=2, temperature=0
    ).usage
    assert usage.prompt_tokens > 20  # the image placeholder was expanded into patch tokens


def test_streaming_with_an_image(sdk: Any) -> None:
    stream = sdk.chat.completions.create(
        model="m", messages=_image_message(_uri(_png((1, 2, 3)))), max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_local_files_only_under_media_path(server: ServeProcess, media_dir: Path) -> None:
    with server.client(headers=AUTH, timeout=120) as client:
        ok = client.post(
            "/v1/chat/completions",
            json={"messages": _image_message(f"file://{media_dir}/green.png"), "max_tokens": 2},
        )
        assert ok.status_code == 200, ok.text
        for url in (f"{media_dir}/../secret.png", str(media_dir.parent / "secret.png")):
            refused = client.post(
                "/v1/chat/completions", json={"messages": _image_message(url), "max_tokens": 2}
            )
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and "outside" in error["message"]


class _Counting(BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        type(self).hits.append(self.path)
        body = _png((5, 5, 5))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_remote_urls_to_private_addresses_are_refused_before_connecting(
    server: ServeProcess,
) -> None:
    internal = ThreadingHTTPServer(("127.0.0.2", 0), _Counting)
    thread = threading.Thread(target=internal.serve_forever, daemon=True)
    thread.start()
    try:
        port = internal.server_address[1]
        with server.client(headers=AUTH, timeout=60) as client:
            for url in (
                f"http://127.0.0.2:{port}/cat.png",
                f"http://0x7f.0.0.2:{port}/cat.png",
                f"http://[::ffff:127.0.0.2]:{port}/cat.png",
                "http://169.254.169.254/latest/meta-data/",
            ):
                answer = client.post(
                    "/v1/chat/completions", json={"messages": _image_message(url), "max_tokens": 2}
                )
                assert answer.status_code == 400, url
                assert answer.json()["error"]["type"] == "invalid_request_error"
        assert _Counting.hits == []
    finally:
        internal.shutdown()
        internal.server_close()


def test_anthropic_image_blocks_also_inside_tool_results(server: ServeProcess) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    data = base64.b64encode(_png((0, 120, 250))).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    message = client.messages.create(
        model="m", max_tokens=3,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Describe"}, image]}],
    )  # fmt: skip
    assert message.usage.input_tokens > 20
    with_tool = client.messages.create(
        model="m", max_tokens=3,
        messages=[
            {"role": "user", "content": "Take a photo"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "camera", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]},
        ],
        tools=[{"name": "camera", "description": "takes a photo",
                "input_schema": {"type": "object", "properties": {}}}],
    )  # fmt: skip
    assert with_tool.usage.input_tokens > message.usage.input_tokens


def test_responses_input_image(sdk: Any) -> None:
    response = sdk.responses.create(
        model="m", max_output_tokens=3, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": _uri(_png((200, 200, 0)))}]}],
    )  # fmt: skip
    assert response.usage.input_tokens > 20


def test_video_reaches_the_native_video_family(server: ServeProcess, tmp_path: Path) -> None:
    clip = tmp_path / "clip.mp4"
    subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i",
         "testsrc=size=56x56:rate=4:duration=1", "-pix_fmt", "yuv420p", str(clip)],
        check=True,
    )  # fmt: skip
    video = {"type": "video_url", "video_url": {"url": _uri(clip.read_bytes(), "video/mp4")}}
    content = [{"type": "text", "text": "Describe"}, video]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    with server.client(headers=AUTH, timeout=120) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 10


def test_bad_media_is_a_clear_400(server: ServeProcess) -> None:
    with server.client(headers=AUTH, timeout=60) as client:
        for url in ("data:image/png;base64,aGVsbG8=", "ftp://example.com/a.png", ""):
            answer = client.post(
                "/v1/chat/completions", json={"messages": _image_message(url), "max_tokens": 2}
            )
            assert answer.status_code == 400, url
        audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
        answer = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": [audio]}], "max_tokens": 2},
        )
        assert answer.status_code == 400 and "audio" in answer.json()["error"]["message"]
        assert client.get("/health").status_code == 200


def test_text_only_servers_refuse_image_parts() -> None:
    """The shipped text model: an image part is the spec's 400, not a crash."""
    body = {"messages": _image_message(_uri(_png((1, 1, 1)))), "max_tokens": 2}
    with (
        ServeProcess(["--api-key", API_KEY, "-c", "512"], env=ENV) as proc,
        proc.client(headers=AUTH, timeout=60) as client,
    ):
        answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 400
        assert "image_url" in answer.json()["error"]["message"]
        assert client.get("/props").json()["modalities"]["vision"] is False


def test_video_reaches_an_image_only_family_as_frames(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    from fixtures.tiny_vlm import build_tiny_gemma3

    model = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))
    clip = tmp_path / "clip.mp4"
    subprocess.run(
        ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i",
         "testsrc=size=56x56:rate=4:duration=2", "-pix_fmt", "yuv420p", str(clip)],
        check=True,
    )  # fmt: skip
    video = {"type": "video_url", "video_url": {"url": _uri(clip.read_bytes(), "video/mp4")}}
    args = ["-m", str(model), "--api-key", API_KEY, "-c", "2048"]
    with (
        ServeProcess([*args, "--video-max-frames", "3"], env=ENV) as proc,
        proc.client(headers=AUTH, timeout=120) as client,
    ):
        props = client.get("/props").json()
        assert props["modalities"]["vision"] is True
        counts = []
        for content in (
            [video],
            [{"type": "image_url", "image_url": {"url": _uri(_png((1, 2, 3)))}}],
        ):
            answer = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 1},
            )
            assert answer.status_code == 200, answer.text
            counts.append(answer.json()["usage"]["prompt_tokens"])
    per_image = counts[1]
    assert counts[0] > per_image  # three frames, each an image's worth of tokens


def _wav_b64(period: float) -> str:
    import wave

    import numpy as np

    samples = (np.sin(np.arange(16000) / period) * 12000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(16000)
        writer.writeframes(samples.tobytes())
    return base64.b64encode(out.getvalue()).decode()


def test_audio_reaches_gemma4(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    from fixtures.tiny_vlm import build_tiny_gemma4

    model = build_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))
    args = ["-m", str(model), "--api-key", API_KEY, "-c", "2048"]
    with ServeProcess(args, env=ENV) as proc:
        sdk = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=API_KEY, max_retries=0)
        with proc.client(headers=AUTH) as client:
            assert client.get("/props").json()["modalities"]["audio"] is True
        tops = []
        for period in (5.0, 50.0):
            result = sdk.chat.completions.create(
                model="m", max_tokens=2, temperature=0, logprobs=True, top_logprobs=5,
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Listen"},
                    {"type": "input_audio",
                     "input_audio": {"data": _wav_b64(period), "format": "wav"}}]}],
            )  # fmt: skip
            assert result.usage.prompt_tokens > 20
            first = result.choices[0].logprobs.content[0]
            tops.append([(t.token, round(t.logprob, 4)) for t in first.top_logprobs])
        assert tops[0] != tops[1]
        clip = tmp_path / "clip.mp4"
        subprocess.run(
            ["ffmpeg", "-nostdin", "-v", "error", "-f", "lavfi", "-i",
             "testsrc=size=48x48:rate=2:duration=1", "-pix_fmt", "yuv420p", str(clip)],
            check=True,
        )  # fmt: skip
        combined = [
            {"type": "video_url", "video_url": {"url": _uri(clip.read_bytes(), "video/mp4")}},
            {"type": "input_audio", "input_audio": {"data": _wav_b64(5.0), "format": "wav"}},
        ]
        with proc.client(headers=AUTH, timeout=120) as client:
            answer = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": combined}], "max_tokens": 1},
            )
        assert answer.status_code == 400
        assert "Combined video and audio inputs are not supported" in answer.text


def test_a_served_cross_attention_model_answers_concurrent_pictures(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tiny Llama 3.2 Vision (mllama) behind `mlxcel serve -np 4`: one slot, so requests
    sent together are answered one after another, each as it is answered alone; another
    picture gives another answer."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from fixtures.tiny_vlm import build_tiny_mllama

    model = build_tiny_mllama(tmp_path_factory.mktemp("mllama"))
    args = ["-m", str(model), "--api-key", API_KEY, "-c", "2048", "-np", "4"]
    with ServeProcess(args, env=ENV) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=API_KEY, max_retries=0)

        def answer(color: tuple[int, int, int]) -> str:
            reply = client.chat.completions.create(
                model="m",
                messages=_image_message(_uri(_png(color))),  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
            )
            return reply.choices[0].message.content or ""

        alone = answer((200, 30, 30))
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(answer, [(200, 30, 30)] * 3))
        other = answer((20, 60, 240))
        health = httpx.get(f"{proc.url}/health", headers=AUTH).json()
    assert alone and together == [alone] * 3
    assert other != alone
    assert health["batch"]["max_batch_size"] == 1
