"""`mlxcel image` as a user runs it: a real subprocess on tiny random-weight pipelines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mflux", reason="image generation needs the image extra (mflux)")

from fixtures.tiny_image import png_size, subprocess_env, tiny_pipeline_dir


@pytest.fixture(scope="module")
def z_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "z-image")


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "flux2-klein")


def _run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", "image", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**base, **subprocess_env(), **env},
        stdin=subprocess.DEVNULL,
    )


def _json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_png_files_of_the_size_with_seed_plus_i(z_dir: Path, tmp_path: Path) -> None:
    args = ["a red cat", "-m", str(z_dir), "--size", "32x16", "--steps", "2", "--json"]
    payload = _json(_run([*args, "--seed", "3", "-n", "2", "-o", "out.png"], tmp_path))
    assert payload["family"] == "z-image" and payload["size"] == "32x16"
    assert payload["steps"] == 2
    files = [tmp_path / item["path"] for item in payload["images"]]
    assert [f.name for f in files] == ["out-1.png", "out-2.png"]
    assert [item["seed"] for item in payload["images"]] == [3, 4]
    pictures = [f.read_bytes() for f in files]
    assert [png_size(p) for p in pictures] == [(32, 16), (32, 16)]
    assert pictures[0] != pictures[1]
    _json(_run([*args, "--seed", "4", "-o", "again.png"], tmp_path))
    assert (tmp_path / "again.png").read_bytes() == pictures[1]  # same seed, same bytes


def test_plain_output_and_img2img(z_dir: Path, tmp_path: Path) -> None:
    first = _run(["a cat", "-m", str(z_dir), "--size", "16x16", "--steps", "1"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "wrote 16x16 image.png" in first.stdout
    assert png_size((tmp_path / "image.png").read_bytes()) == (16, 16)
    args = ["a dog", "-m", str(z_dir), "--size", "16x32", "--steps", "4", "--json"]
    moved = _json(
        _run([*args, "--image", "image.png", "--strength", "0.5", "-o", "dog.png"], tmp_path)
    )
    assert moved["steps"] == 2  # img2img skips the steps the picture replaces
    assert png_size((tmp_path / "dog.png").read_bytes()) == (16, 32)


def test_flux2_klein_edit_with_two_references(klein_dir: Path, tmp_path: Path) -> None:
    base = ["-m", str(klein_dir), "--size", "16x16", "--steps", "2", "--json", "--seed", "1"]
    _json(_run(["a cat", *base, "-o", "cat.png"], tmp_path))
    edited = _json(
        _run(
            ["make it blue", *base, "-i", "cat.png", "--image", "cat.png", "-o", "blue.png"],
            tmp_path,
        )
    )
    assert edited["family"] == "flux2-klein"
    assert png_size((tmp_path / "blue.png").read_bytes()) == (16, 16)
    assert (tmp_path / "blue.png").read_bytes() != (tmp_path / "cat.png").read_bytes()


def test_settings_layering_profile_env_flag(z_dir: Path, tmp_path: Path) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text(f'[model]\nimage_model = "{z_dir}"\n')
    quick = ["x", "--size", "16x16", "--steps", "1", "--json"]
    assert _json(_run([*quick, "-P", str(profile)], tmp_path))["model"] == z_dir.name
    # env beats the profile, the flag beats the env
    missing = tmp_path / "from-env"
    over = _run([*quick, "-P", str(profile)], tmp_path, MLXCEL_IMAGE_MODEL=str(missing))
    assert over.returncode == 2 and "from-env" in over.stderr
    flag = _run([*quick, "-m", str(z_dir)], tmp_path, MLXCEL_IMAGE_MODEL=str(missing))
    assert _json(flag)["model"] == z_dir.name


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["x", "--size", "30x16"], "multiple of 16"),
        (["x", "--strength", "0.5"], "strength needs an input image"),
        (["x", "-n", "0"], "n must be"),
        (["x", "--image", "nope.png"], "cannot read nope.png"),
        (["x", "--image", "."], "is a directory"),
    ],
)
def test_usage_errors_are_one_line_exit_2(
    z_dir: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    result = _run([*args, "-m", str(z_dir)], tmp_path)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("mlxcel: error:")


def test_no_model_and_too_many_images(z_dir: Path, tmp_path: Path) -> None:
    none = _run(["x"], tmp_path)
    assert none.returncode == 2 and "MLXCEL_IMAGE_MODEL" in none.stderr
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    bad = _run(["x", "-m", str(z_dir), "--image", "bad.png"], tmp_path)
    assert bad.returncode == 2 and "not a readable image" in bad.stderr
    first = _run(["a", "-m", str(z_dir), "--size", "16x16", "--steps", "1"], tmp_path)
    assert first.returncode == 0, first.stderr
    two = _run(["x", "-m", str(z_dir), "-i", "image.png", "-i", "image.png"], tmp_path)
    assert two.returncode == 2 and "one input image" in two.stderr
