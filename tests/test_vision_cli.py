"""`mlxcel generate --image/--video/--audio` through the real CLI on a tiny Qwen2-VL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")

from fixtures.tiny_vlm import build_tiny_qwen2_vl  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "MLX_DISABLE_COMPILE": "1", "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from PIL import Image

    root = tmp_path_factory.mktemp("pictures")
    out = {}
    for name, color in (("red", (250, 0, 0)), ("blue", (0, 0, 250))):
        picture = Image.new("RGB", (64, 64), color)
        for x in range(0, 64, 8):
            for y in range(64):
                picture.putpixel((x, y), (255 - color[0], 255, 255 - color[2]))
        out[name] = root / f"{name}.png"
        picture.save(out[name])
    return out


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "mlxcel", "generate", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


def test_generate_with_images(model: Path, pictures: dict[str, Path]) -> None:
    common = ["-m", str(model), "--temp", "0", "-n", "6", "--json", "What is it?"]
    red = _generate("--image", str(pictures["red"]), *common)
    assert red.returncode == 0, red.stderr
    one = json.loads(red.stdout)
    two = json.loads(
        _generate("--image", str(pictures["red"]), "--image", str(pictures["blue"]), *common).stdout
    )
    text_only = json.loads(_generate(*common).stdout)
    assert one["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"]
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]
    again = json.loads(_generate("--image", str(pictures["red"]), *common).stdout)
    assert again["text"] == one["text"]


def test_generate_media_errors_are_one_line(model: Path, pictures: dict[str, Path]) -> None:
    cases = [
        (["--image", str(pictures["red"]), "hi"], "need a vision model"),
        (["-m", str(model), "--audio", str(pictures["red"]), "hi"], "does not accept audio"),
        (["-m", str(model), "--image", "/nonexistent.png", "hi"], "No such file"),
        (["-m", str(model), "--image", str(model / "config.json"), "hi"], "image"),
    ]
    for args, message in cases:
        result = _generate(*args, "-n", "2")
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr


def test_a_bad_media_file_is_named(model: Path, pictures: dict[str, Path], tmp_path: Path) -> None:
    """Of several --image files, the error named none ('image data is corrupt or
    truncated'); it names the one that does not decode."""
    cut = tmp_path / "cut.png"
    cut.write_bytes(pictures["blue"].read_bytes()[:100])
    args = ["-m", str(model), "--image", str(pictures["red"]), "--image", str(cut), "hi"]
    result = _generate(*args, "-n", "2")
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"mlxcel: error: --image {cut}: image data is"), line
    video = _generate("-m", str(model), "--video", str(cut), "hi", "-n", "2")
    assert video.returncode == 2
    assert f"mlxcel: error: --video {cut}: " in video.stderr
