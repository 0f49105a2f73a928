"""The vision engine on a tiny random-weight Qwen2-VL that mlx-vlm loads offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")

from fixtures.tiny_vlm import build_tiny_qwen2_vl  # noqa: E402

from mlxcel.engine.errors import InvalidRequestError, QueueFullError  # noqa: E402
from mlxcel.engine.sampling.params import SamplingParams  # noqa: E402
from mlxcel.engine.text.request import GenerationRequest  # noqa: E402
from mlxcel.engine.vision.engine import VisionEngine  # noqa: E402
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt  # noqa: E402
from mlxcel.engine.vision.loader import is_vision_model_dir, load_vision_model  # noqa: E402

PROMPT = (
    "<|im_start|>user\nWhat is in the picture?<|vision_start|><|image_pad|><|vision_end|>"
    "<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> VisionEngine:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))
    loaded = load_vision_model(path, name="tiny-qwen2-vl")
    vision = VisionEngine(loaded).start()
    yield vision
    vision.stop()


def _image(color: tuple[int, int, int]) -> object:
    from PIL import Image

    picture = Image.new("RGB", (64, 64), color)
    for x in range(0, 64, 8):  # some structure, so patches differ from each other
        for y in range(64):
            picture.putpixel((x, y), (255 - color[0], 255 - color[1], 255 - color[2]))
    return picture


def _run(engine: VisionEngine, inputs: VisionInputs, **fields: object) -> list:
    request = GenerationRequest(
        prompt_tokens=[],
        max_tokens=int(fields.pop("max_tokens", 6)),  # type: ignore[call-overload]
        sampling=SamplingParams(temperature=0.0),
        media=VisionPrompt(
            PROMPT
            if inputs.images
            else PROMPT.replace("<|vision_start|><|image_pad|><|vision_end|>", ""),
            inputs,
        ),
        **fields,  # type: ignore[arg-type]
    )
    return list(engine.generate(request))


def test_detects_and_reports_modalities(engine: VisionEngine, tmp_path: Path) -> None:
    assert is_vision_model_dir(engine.loaded.info.path)
    assert not is_vision_model_dir(tmp_path)
    assert engine.modalities == {"text", "image", "video"}
    assert engine.loaded.native_video
    assert engine.loaded.info.architecture == "qwen2_vl"


def test_an_image_changes_the_first_step_logits(engine: VisionEngine) -> None:
    red = _run(engine, VisionInputs(images=[_image((250, 0, 0))]), logprobs=5)
    blue = _run(engine, VisionInputs(images=[_image((0, 0, 250))]), logprobs=5)
    first_red, first_blue = red[0].logprobs[0], blue[0].logprobs[0]
    assert first_red.top != first_blue.top
    # the placeholder was expanded into the image's patch tokens
    assert red[-1].prompt_tokens > len(PROMPT) // 8
    assert red[-1].finished and red[-1].timings is not None


def test_same_request_is_deterministic(engine: VisionEngine) -> None:
    inputs = VisionInputs(images=[_image((10, 200, 30))])
    first = _run(engine, inputs, max_tokens=8)
    second = _run(engine, inputs, max_tokens=8)
    tokens = [t for e in first for t in e.token_ids]
    assert tokens == [t for e in second for t in e.token_ids]
    assert len(tokens) == first[-1].completion_tokens


def test_text_only_request_on_a_vision_model(engine: VisionEngine) -> None:
    events = _run(engine, VisionInputs(), max_tokens=4)
    assert events[-1].finish_reason in ("length", "stop")
    assert events[-1].completion_tokens <= 4


def test_media_digest_is_by_content() -> None:
    a = VisionInputs(images=[_image((1, 2, 3))])
    b = VisionInputs(images=[_image((1, 2, 3))])
    c = VisionInputs(images=[_image((3, 2, 1))])
    assert a.digest() == b.digest() != c.digest()


def test_media_digest_reads_every_pixel_in_strips() -> None:
    """A picture is hashed a strip of rows at a time: the digest is that of all its pixels
    in one piece, and a pixel changed in its last row changes it."""
    import hashlib

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (150, 70, 3), dtype=np.uint8)
    picture = Image.fromarray(pixels)
    whole = hashlib.sha256(b"image" + f"{picture.size}{picture.mode}".encode())
    whole.update(picture.tobytes())
    assert VisionInputs(images=[picture]).digest() == whole.hexdigest()
    pixels[-1, -1, 0] ^= 1
    changed = VisionInputs(images=[Image.fromarray(pixels)])
    assert changed.digest() != whole.hexdigest()


def test_unsupported_media_is_a_clear_error(engine: VisionEngine) -> None:
    import numpy as np

    with pytest.raises(InvalidRequestError, match="audio"):
        _run(engine, VisionInputs(audio=[np.zeros(1600, dtype="float32")]))


def test_cancel_and_queue_full(engine: VisionEngine) -> None:
    request = GenerationRequest(
        prompt_tokens=[],
        max_tokens=200,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        media=VisionPrompt(PROMPT, VisionInputs(images=[_image((5, 5, 5))])),
    )
    stream = engine.generate(request)
    next(stream)
    engine.cancel(request.request_id)
    events = list(stream)
    assert events[-1].finish_reason == "cancelled"
    full = VisionEngine(engine.loaded, max_queue_depth=0)
    with pytest.raises(QueueFullError):
        full.submit(
            GenerationRequest(prompt_tokens=[], media=VisionPrompt("hello", VisionInputs())),
            lambda e: None,
        )


GEMMA_PROMPT = (
    "<bos><start_of_turn>user\nWhat is this?<start_of_image><end_of_turn>\n<start_of_turn>model\n"
)


def test_gemma3_images_change_the_first_step(tmp_path: Path) -> None:
    from fixtures.tiny_vlm import build_tiny_gemma3

    loaded = load_vision_model(build_tiny_gemma3(tmp_path / "g3"), name="tiny-gemma3")
    assert loaded.modalities == {"text", "image", "video"} and not loaded.native_video
    gemma = VisionEngine(loaded).start()
    try:
        tops = []
        for color in ((250, 0, 0), (0, 0, 250)):
            request = GenerationRequest(
                prompt_tokens=[],
                max_tokens=2,
                sampling=SamplingParams(temperature=0.0),
                logprobs=5,
                media=VisionPrompt(GEMMA_PROMPT, VisionInputs(images=[_image(color)])),
            )
            events = list(gemma.generate(request))
            tops.append(events[0].logprobs[0].top if events[0].logprobs else None)
            assert events[-1].prompt_tokens > len(GEMMA_PROMPT) // 8
        assert tops[0] is not None and tops[0] != tops[1]
    finally:
        gemma.stop()


def test_gemma4_audio_changes_the_first_step(tmp_path: Path) -> None:
    import numpy as np
    from fixtures.tiny_vlm import build_tiny_gemma4

    loaded = load_vision_model(build_tiny_gemma4(tmp_path / "g4"), name="tiny-gemma4")
    assert loaded.modalities == {"text", "image", "video", "audio"}
    engine = VisionEngine(loaded).start()
    prompt = "<bos><start_of_turn>user\nListen<|audio|><end_of_turn>\n<start_of_turn>model\n"
    try:
        tops = []
        for period in (5.0, 50.0):
            clip = (np.sin(np.arange(16000) / period) * 0.3).astype(np.float32)
            request = GenerationRequest(
                prompt_tokens=[],
                max_tokens=2,
                sampling=SamplingParams(temperature=0.0),
                logprobs=5,
                media=VisionPrompt(prompt, VisionInputs(audio=[clip])),
            )
            events = list(engine.generate(request))
            assert events[-1].finish_reason in ("length", "stop"), events[-1].error
            tops.append(events[0].logprobs[0].top)
            assert events[-1].prompt_tokens > len(prompt) // 8  # audio soft tokens added
        assert tops[0] != tops[1]
    finally:
        engine.stop()
