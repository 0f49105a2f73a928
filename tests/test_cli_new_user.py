"""What a new user meets on the command line: output layout, messages, help, docs links.

Every check runs the real `mlxcel` command in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mlxcel(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None, merged: bool = False
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        input=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        timeout=180,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def test_generate_ends_its_text_with_a_newline_before_the_stats(tiny_llama_dir: Path) -> None:
    # stdout and stderr on one pipe, as in `mlxcel generate ... 2>&1 | less`
    out = _mlxcel(
        "generate", "-m", str(tiny_llama_dir), "-n", "3", "--temp", "0", "hi", merged=True
    )
    assert out.returncode == 0, out.stdout
    text, stats = out.stdout.rsplit("\nprompt: ", 1)
    assert text.strip()  # the generated text, then its newline, then the stats line
    assert stats.endswith("\n") and "generation: 3 tokens, " in stats and " tok/s" in stats
    alone = _mlxcel("generate", "-m", str(tiny_llama_dir), "-n", "3", "--temp", "0", "hi")
    assert alone.stdout.endswith("\n") and not alone.stdout.endswith("\n\n")


def test_generate_n0_prints_no_rate(tiny_llama_dir: Path) -> None:
    out = _mlxcel("generate", "-m", str(tiny_llama_dir), "-n", "0", "hi")
    assert out.returncode == 0, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert "tok/s" not in line
    assert "(not evaluated with -n 0)" in line and "generation: 0 tokens |" in line


@pytest.mark.slow
def test_generate_on_the_default_gguf_prints_only_its_stats_line(smollm2_gguf: Path) -> None:
    # transformers' "PyTorch was not found" advisory is not mlxcel's to show a user
    for _ in ("converting", "from the store"):
        out = _mlxcel("generate", "-m", str(smollm2_gguf), "-n", "0", "hi")
        assert out.returncode == 0, out.stderr
        [line] = out.stderr.strip().splitlines()
        assert line.startswith("prompt: "), line


def test_bad_model_file_is_named_once(tmp_path: Path) -> None:
    bad = tmp_path / "notamodel.gguf"
    bad.write_bytes(b"this is not a model")
    for path in (str(bad), str(tmp_path / "missing.gguf")):
        out = _mlxcel("generate", "-m", path, "hi")
        assert out.returncode == 2
        [line] = out.stderr.strip().splitlines()
        name = Path(path).name
        assert line.startswith("mlxcel: error: ") and line.count(name) == 1, line


def test_speak_error_names_its_own_option() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLXCEL_TTS_MODEL"}
    out = subprocess.run(
        [sys.executable, "-m", "mlxcel", "speak", "-o", os.devnull, "hello"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert "--tts-model" not in line
    assert "-m/--model" in line and "MLXCEL_TTS_MODEL" in line


@pytest.fixture(scope="module")
def stored_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """A store holding one converted GGUF (a model `cache rm` can remove)."""
    from fixtures.tiny_models import build_tiny_model, write_tiny_gguf

    base = tmp_path_factory.mktemp("store")
    gguf = write_tiny_gguf(build_tiny_model(base / "src"), base / "tiny-rm.gguf", "Q8_0")
    env = {"MLXCEL_MODEL_STORE": str(base / "store"), "HF_HUB_CACHE": str(base / "hf")}
    out = _mlxcel("generate", "-m", str(gguf), "-n", "1", "hi", env=env)
    assert out.returncode == 0, out.stderr
    listing = _mlxcel("cache", "list", "--json", env=env)
    import json

    names = [row["name"] for row in json.loads(listing.stdout) if row["kind"] == "mlxcel-store"]
    assert len(names) == 1
    return names[0], env


def test_cache_rm_answered_no_says_so_and_keeps_the_model(
    stored_model: tuple[str, dict[str, str]],
) -> None:
    name, env = stored_model
    for answer in ("n\n", ""):  # "n", then no answer at all (end of input)
        out = _mlxcel("cache", "rm", name, stdin=answer, env=env)
        assert out.returncode == 0, out.stderr
        assert f"kept {name} (nothing removed)" in out.stderr
        assert name in _mlxcel("cache", "list", "--json", env=env).stdout
    removed = _mlxcel("cache", "rm", name, stdin="y\n", env=env)
    assert removed.returncode == 0 and f"removed {name}" in removed.stdout
    assert name not in _mlxcel("cache", "list", "--json", env=env).stdout


def test_help_shows_no_bool_metavar_and_generate_shows_defaults() -> None:
    from mlxcel.config import field_meta
    from mlxcel.config.llama_flags import _show_value

    for command in (["generate"], ["embed"], ["cache", "list"], ["transcribe"], ["bench"]):
        out = _mlxcel(*command, "--help")
        assert out.returncode == 0, out.stderr
        assert "<bool>" not in out.stdout, command
    help_text = " ".join(_mlxcel("generate", "--help").stdout.split())
    for shown in ("[default: (0.8)]", "[default: (40)]", "[default: (the built-in SmolLM2)]"):
        assert shown in help_text
    # The defaults help shows are the settings' own.
    from mlxcel.commands.common import SETTING_DEFAULTS

    for name, text in SETTING_DEFAULTS.items():
        assert text == _show_value(field_meta(name).default), name


def test_docs_links_resolve() -> None:
    """Every relative link in README.md and docs/ names a file that exists."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in link.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["generate", "-n", "abc", "hi"],
            "mlxcel: error: invalid value for '--predict' / '-n' / '--n-predict' / "
            "'--max-tokens': Input should be a valid integer, unable to parse string as an "
            "integer (see `mlxcel generate -h`)",
        ),
        (
            ["speak", "--speed", "fast", "hi"],
            "mlxcel: error: invalid value for '--speed': Input should be a valid number, "
            "unable to parse string as a number (see `mlxcel speak -h`)",
        ),
        (
            ["rerank", "doc"],
            "mlxcel: error: missing option '--query' / '-q' (see `mlxcel rerank -h`)",
        ),
        (["cache", "info"], "mlxcel: error: missing argument 'name' (see `mlxcel cache info -h`)"),
        (
            ["tokenize", "a", "b"],
            "mlxcel: error: got unexpected extra argument(s) (b) (see `mlxcel tokenize -h`)",
        ),
        (
            ["transcribe", "--xyzzy"],
            "mlxcel: error: no such option: --xyzzy (see `mlxcel transcribe -h`)",
        ),
        (["nosuchcommand"], "mlxcel: error: no such command 'nosuchcommand' (see `mlxcel -h`)"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], line: str) -> None:
    """A flag the parser refuses gets the one `mlxcel: error:` line every other bad input
    gets, not Typer's usage line, hint and framed box."""
    out = _mlxcel(*args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [line]
    assert out.stdout == ""


def test_bare_group_still_prints_its_help() -> None:
    for args in ([], ["cache"]):
        out = _mlxcel(*args)
        assert out.returncode == 2 and "Usage: mlxcel" in out.stdout
        assert "error" not in out.stderr


CTRL_C_WHILE_IMPORTING = """
import sys


class CtrlC:
    # What Python does with a Ctrl-C that lands while the CLI still imports its libraries.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("typer", "rich"):
            raise KeyboardInterrupt
        return None


sys.meta_path.insert(0, CtrlC())
from mlxcel.cli import main

main()
"""


def test_ctrl_c_while_the_cli_starts_is_exit_130_without_a_traceback() -> None:
    """Ctrl-C in the first half second (Typer and rich loading) printed a traceback through
    the import machinery: the console script imported the app before `main` could catch it."""
    out = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_IMPORTING, "generate", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 130, out.stderr
    assert out.stderr == "" and out.stdout == ""


def _cut_weights(source: Path, target: Path) -> Path:
    """A copy of the model directory `source` whose safetensors files stop halfway, as an
    interrupted download leaves them."""
    import shutil

    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    return target


def test_model_dirs_with_cut_off_weights_are_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A truncated safetensors file was a traceback from MLX's reader (RuntimeError) for a
    text model, Whisper and Kokoro; it is one line naming the file."""
    from fixtures.audio import speech_wav, tiny_kokoro_dir, tiny_whisper_dir

    text = _cut_weights(tiny_llama_dir, tmp_path / "text")
    whisper = _cut_weights(tiny_whisper_dir(), tmp_path / "whisper")
    kokoro = _cut_weights(tiny_kokoro_dir(), tmp_path / "kokoro")
    for args, name in (
        (["generate", "-m", str(text), "-n", "1", "hi"], "text"),
        (["transcribe", "-m", str(whisper), str(speech_wav())], "whisper"),
        (["speak", "-m", str(kokoro), "--phonemes", "-o", os.devnull, "hɛloʊ"], "kokoro"),
    ):
        out = _mlxcel(*args)
        assert out.returncode == 2, out.stderr
        [line] = out.stderr.strip().splitlines()
        assert line.startswith(f"mlxcel: error: {name}: "), line
        assert ".safetensors is truncated or corrupt (" in line, line
