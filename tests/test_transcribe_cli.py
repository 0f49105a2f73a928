"""`mlxcel transcribe` and `mlxcel speak` through Typer's CliRunner on the command functions.

The real-model test turns a Piper recording into the right words with the shipped Whisper
tiny.en; the others use tiny random Whisper and Kokoro checkpoints.
"""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import pytest
import typer
from fixtures.audio import SENTENCE, speech_wav, tiny_kokoro_dir, tiny_whisper_dir, word_error_rate
from mlxcel.commands import speak, transcribe
from typer.testing import CliRunner

app = typer.Typer()
app.command("transcribe")(transcribe.transcribe)
app.command("speak")(speak.speak)
runner = CliRunner()


def run(*args: str, stdin: bytes | str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def assert_fails(args: list[str], needle: str, stdin: bytes | None = None) -> None:
    code, _, err = run(*args, stdin=stdin)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    assert needle in lines[0]


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(tiny_whisper_dir())


@pytest.fixture(scope="module")
def wav() -> Path:
    return speech_wav()


# --------------------------------------------------------------------------- transcribe


@pytest.mark.slow
def test_real_recording_with_the_shipped_tiny_en(wav: Path) -> None:
    code, out, err = run("transcribe", str(wav), "--quiet")
    assert code == 0, err
    assert word_error_rate(SENTENCE, out) == 0.0, out
    assert out.strip().endswith(".") and out.count("\n") == 1


def test_formats_and_output_file(tiny: str, wav: Path, tmp_path: Path) -> None:
    code, text, _ = run("transcribe", str(wav), "-m", tiny, "-q")
    assert code == 0 and text.endswith("\n")
    code, raw, _ = run("transcribe", str(wav), "-m", tiny, "-f", "json", "-q")
    assert code == 0 and json.loads(raw) == {"text": text.strip()}
    out = tmp_path / "speech.srt"
    code, stdout, _ = run("transcribe", str(wav), "-m", tiny, "-f", "srt", "-o", str(out), "-q")
    assert code == 0 and stdout == ""
    srt = out.read_text()
    assert srt.startswith("1\n00:00:") and " --> " in srt
    code, vtt, _ = run("transcribe", str(wav), "-m", tiny, "-f", "vtt", "--word-timestamps", "-q")
    assert code == 0 and vtt.startswith("WEBVTT\n")


def test_verbose_json_with_word_timestamps(tiny: str, wav: Path) -> None:
    code, raw, _ = run(
        "transcribe", str(wav), "-m", tiny, "-f", "verbose_json", "--word-timestamps", "-q"
    )
    assert code == 0
    body = json.loads(raw)
    assert body["task"] == "transcribe" and body["language"] == "english"
    with wave.open(str(wav)) as recording:
        seconds = recording.getnframes() / recording.getframerate()
    assert body["duration"] == pytest.approx(seconds, abs=1e-3)
    assert body["segments"] and body["words"]
    assert all(0 <= w["start"] <= w["end"] <= body["duration"] for w in body["words"])


def test_stdin_and_several_files(tiny: str, wav: Path, tmp_path: Path) -> None:
    code, from_file, _ = run("transcribe", str(wav), "-m", tiny, "-q")
    code_stdin, from_stdin, _ = run("transcribe", "-", "-m", tiny, "-q", stdin=wav.read_bytes())
    assert code == code_stdin == 0 and from_stdin == from_file
    second = tmp_path / "again.wav"
    second.write_bytes(wav.read_bytes())
    code, both, _ = run("transcribe", str(wav), str(second), "-m", tiny, "-q")
    assert code == 0
    assert both == f"==> {wav} <==\n{from_file}==> {second} <==\n{from_file}"
    folder = tmp_path / "out"
    code, _, _ = run(
        "transcribe", str(wav), str(second), "-m", tiny, "-f", "json", "-o", str(folder), "-q"
    )
    assert code == 0
    assert sorted(p.name for p in folder.iterdir()) == ["again.json", "speech.json"]
    assert json.loads((folder / "again.json").read_text())["text"] == from_file.strip()


def test_progress_bar_on_a_terminal(tiny: str, wav: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats stderr as a terminal
    monkeypatch.setattr(transcribe, "PROGRESS_AFTER_SECONDS", 1.0)
    code, out, err = run("transcribe", str(wav), "-m", tiny)
    quiet_code, quiet_out, quiet_err = run("transcribe", str(wav), "-m", tiny, "-q")
    assert code == quiet_code == 0 and out == quiet_out
    assert str(wav) in err and "━" in err and "3/3 s" in err  # the bar ran to the end
    assert quiet_err == ""


def test_bad_input_is_one_line_and_exit_2(tiny: str, wav: Path, tmp_path: Path) -> None:
    song = tmp_path / "song.mp3"
    song.write_bytes(b"ID3\x04" + b"\x00" * 64)
    assert_fails(["transcribe", str(tmp_path / "missing.wav")], "cannot read")
    assert_fails(["transcribe", str(tmp_path)], "is a directory")
    assert_fails(["transcribe", str(song), "-m", tiny], "song.mp3")
    assert_fails(["transcribe", "-"], "stdin: empty audio file", stdin=b"")
    assert_fails(["transcribe", str(wav), "-f", "docx"], "unknown format 'docx'")
    assert_fails(["transcribe", str(wav), "--task", "summarize"], "unknown task")
    assert_fails(["transcribe", str(wav), "--word-timestamps"], "--word-timestamps needs")
    assert_fails(["transcribe", str(wav), "-l", "elvish"], "unknown language")
    assert_fails(["transcribe", str(wav), "-m", tiny, "-l", "fr"], "English-only")
    assert_fails(["transcribe", str(wav), "-m", str(tmp_path)], "not a Whisper model")


def test_ffmpeg_missing_message(tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.engine.audio import codec

    monkeypatch.setattr(codec, "find_ffmpeg", lambda: None)
    clip = tmp_path / "clip.ogg"
    clip.write_bytes(b"OggS" + b"\x00" * 64)
    assert_fails(["transcribe", str(clip), "-m", tiny], "ffmpeg is not installed")


# --------------------------------------------------------------------------- speak


def test_speak_writes_a_24khz_wav(tmp_path: Path) -> None:
    out = tmp_path / "hi.wav"
    model = str(tiny_kokoro_dir())
    code, _, err = run("speak", "hˈI", "--phonemes", "-m", model, "-o", str(out))
    assert code == 0, err
    assert "af_heart" in err and "24000 Hz" in err
    with wave.open(str(out)) as audio:
        assert audio.getframerate() == 24_000 and audio.getnchannels() == 1
        assert audio.getsampwidth() == 2 and audio.getnframes() > 0


def test_speak_stdin_voices_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(speak.MODEL_ENV, raising=False)
    model = str(tiny_kokoro_dir())
    code, out, _ = run("speak", "--list-voices", "-m", model)
    assert code == 0 and out.splitlines() == ["af_heart  (default)", "bm_fable"]
    assert_fails(["speak", "-", "-m", model, "-o", "-"], "the text is empty", stdin=b"")
    assert_fails(["speak", "[[hˈI]]", "-m", model, "-o", "x.wav", "-v", "zz"], "unknown voice")
    assert_fails(["speak", "[[hˈI]]", "-m", model, "-o", "x.wav", "--speed", "9"], "--speed")
    assert_fails(["speak", "[[hˈI]]", "-o", "x.wav"], "no text-to-speech model")
    assert_fails(["speak", "-m", model], "missing TEXT")
    monkeypatch.setattr(speak.shutil, "which", lambda _name: None)
    assert_fails(["speak", "[[hˈI]]", "-m", model], "no audio player found")
    monkeypatch.setenv(speak.MODEL_ENV, model)
    result = runner.invoke(app, ["speak", "-", "-o", "-", "-q"], input="[[hˈI]]")
    assert result.exit_code == 0 and result.stderr == ""
    with wave.open(io.BytesIO(result.stdout_bytes)) as audio:
        assert audio.getframerate() == 24_000 and audio.getnframes() > 0
