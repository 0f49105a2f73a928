"""Bytes a user's shell can hand the CLI that are no text: one line on stderr, exit 2.

Every check runs the real `mlxcel` command in a subprocess, with raw bytes on argv or stdin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NOT_UTF8 = b"caf\xe9 \xff\xfe"  # Latin-1 bytes, as a file from an old editor holds them


def _mlxcel(*args: str | bytes, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        input=stdin,
        capture_output=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "120"},
    )


def _one_error_line(out: subprocess.CompletedProcess[bytes], message: str) -> None:
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [f"mlxcel: error: {message}"]


@pytest.mark.parametrize("command", ["generate", "tokenize"])
def test_stdin_that_is_not_utf8_is_one_line(command: str, tiny_llama_dir: Path) -> None:
    out = _mlxcel(command, "-m", str(tiny_llama_dir), "-", stdin=NOT_UTF8)
    _one_error_line(out, "stdin is not UTF-8 text")


def test_stdin_in_utf8_still_reads(tiny_llama_dir: Path) -> None:
    out = _mlxcel("tokenize", "-m", str(tiny_llama_dir), "-", "--count", stdin="café".encode())
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "-n", "1", NOT_UTF8], "the prompt is not UTF-8 text"),
        (["generate", "-n", "1", "--system", NOT_UTF8, "hi"], "--system is not UTF-8 text"),
        (["tokenize", NOT_UTF8], "TEXT is not UTF-8 text"),
    ],
)
def test_arguments_that_are_not_utf8_are_one_line(
    args: list[str | bytes], message: str, tiny_llama_dir: Path
) -> None:
    out = _mlxcel(args[0], "-m", str(tiny_llama_dir), *args[1:])
    _one_error_line(out, message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["embed", NOT_UTF8], "an argument is not UTF-8 text"),
        (["rerank", "-q", NOT_UTF8, "doc"], "the query is not UTF-8 text"),
        (["rerank", "-q", "query", NOT_UTF8], "an argument is not UTF-8 text"),
    ],
)
def test_encoder_texts_that_are_not_utf8_are_one_line(
    args: list[str | bytes], message: str
) -> None:
    _one_error_line(_mlxcel(*args), message)


def test_embed_npy_writes_the_path_it_names(tmp_path: Path) -> None:
    import numpy as np

    named = tmp_path / "vectors"  # no .npy: np.save alone would write vectors.npy
    out = _mlxcel("embed", "tea", "coffee", "--npy", str(named))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vectors"]
    assert np.load(named).shape == (2, 384)
    assert out.stderr.decode().strip() == f"mlxcel: wrote 2×384 float32 to {named}"


def test_embed_npy_to_a_directory_is_one_line(tmp_path: Path) -> None:
    out = _mlxcel("embed", "tea", "--npy", str(tmp_path))
    _one_error_line(out, f"cannot write {tmp_path}: Is a directory")
    assert list(tmp_path.parent.glob(f"{tmp_path.name}.npy")) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([NOT_UTF8], "the prompt is not UTF-8 text"),
        (["a cat", "--negative-prompt", NOT_UTF8], "--negative-prompt is not UTF-8 text"),
    ],
)
def test_image_prompts_that_are_not_utf8_are_one_line(
    args: list[str | bytes], message: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from fixtures.tiny_image import tiny_pipeline_dir

    model = tiny_pipeline_dir(tmp_path_factory.getbasetemp(), "z-image")
    out_png = tmp_path_factory.mktemp("png") / "out.png"
    flags = ["-m", str(model), "-o", str(out_png), "--size", "64x64", "--steps", "1"]
    _one_error_line(_mlxcel("image", *args, *flags, "--guidance", "2"), message)
    assert not out_png.exists()


def test_chat_template_file_that_is_not_utf8_is_one_line(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    template = tmp_path / "latin.jinja"
    template.write_bytes(b"{{ 'caf\xe9' }}")
    out = _mlxcel(
        "generate", "-m", str(tiny_llama_dir), "--chat-template-file", str(template), "hi"
    )
    _one_error_line(out, f"cannot read chat template file {template}: not UTF-8 text")


def _fake_player(folder: Path, name: str, stderr: str, status: int) -> Path:
    """A `name` first on PATH that writes `stderr` and exits `status` (ffplay, with no audio
    device, says so and exits 0). afplay is the first player mlxcel looks for."""
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text(f"#!/bin/sh\nprintf '{stderr}' >&2\nexit {status}\n")
    script.chmod(0o755)
    return folder


@pytest.mark.parametrize(
    ("stderr", "status", "reason"),
    [
        ("audio open failed\\nFailed to open file\\n", 0, "Failed to open file"),
        ("", 3, "exit status 3"),
    ],
)
def test_speak_that_cannot_play_fails(
    stderr: str, status: int, reason: str, tmp_path: Path
) -> None:
    from fixtures.audio import tiny_kokoro_dir

    path = _fake_player(tmp_path / "bin", "afplay", stderr, status)
    out = subprocess.run(
        [sys.executable, "-m", "mlxcel", "speak", "-m", str(tiny_kokoro_dir()), "hello"],
        capture_output=True,
        timeout=180,
        env={**os.environ, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"},
    )
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert err.strip().splitlines() == [
        f"mlxcel: error: afplay could not play the audio ({reason}); use -o out.wav"
    ]


def test_speak_that_plays_says_so_after(tmp_path: Path) -> None:
    from fixtures.audio import tiny_kokoro_dir

    path = _fake_player(tmp_path / "bin", "afplay", "", 0)
    out = subprocess.run(
        [sys.executable, "-m", "mlxcel", "speak", "-m", str(tiny_kokoro_dir()), "hello"],
        capture_output=True,
        timeout=180,
        env={**os.environ, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.decode().strip().endswith("→ the speakers")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full is Linux's")
@pytest.mark.parametrize("args", [["generate", "-n", "2", "hi"], ["tokenize", "hi"]])
def test_output_to_a_full_disk_is_one_line(args: list[str], tiny_llama_dir: Path) -> None:
    """A write to stdout failing (ENOSPC) was a traceback, or Python's 'Exception ignored'
    at exit; it is one line and exit 1."""
    with open("/dev/full", "wb") as full:
        out = subprocess.run(
            [sys.executable, "-m", "mlxcel", args[0], "-m", str(tiny_llama_dir), *args[1:]],
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=180,
        )
    err = out.stderr.decode()
    assert out.returncode == 1, err
    assert [line for line in err.splitlines() if line.startswith("mlxcel:")] == [
        "mlxcel: error: No space left on device"
    ]
    assert "Traceback" not in err and "Exception ignored" not in err


def test_closed_stdout_writes_into_nothing(tiny_llama_dir: Path) -> None:
    """`mlxcel generate ... >&-` failed on `sys.stdout.write` (stdout is None then);
    it runs as print() does, writing nothing."""
    command = f'exec "{sys.executable}" -m mlxcel generate -m "{tiny_llama_dir}" -n 2 hi >&-'
    out = subprocess.run(["sh", "-c", command], capture_output=True, timeout=180)
    err = out.stderr.decode()
    assert out.returncode == 0, err
    assert "Traceback" not in err and err.startswith("prompt: ")
