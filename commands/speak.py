"""Speak text with Kokoro-82M: write a 24 kHz WAV file, or play it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from mlxcel.config import process_env

from .common import fail, stdin_text, utf8_text

if TYPE_CHECKING:
    from mlxcel.engine.audio.tts import KokoroModel

MODEL_ENV = process_env.TTS_MODEL
PLAYERS = (
    ("afplay",),
    ("pw-play",),
    ("paplay",),
    ("aplay", "-q"),
    ("ffplay", "-nodisp", "-autoexit", "-loglevel", "error"),
)


def find_player() -> list[str] | None:
    """The first audio player on PATH, as a command prefix (the WAV path goes last)."""
    for command in PLAYERS:
        program = shutil.which(command[0])
        if program is not None:
            return [program, *command[1:]]
    return None


def _load(ref: str | None, quiet: bool) -> KokoroModel:
    from rich.console import Console

    from mlxcel.engine.audio.tts import load_kokoro
    from mlxcel.engine.errors import EngineError

    console = Console(stderr=True)
    try:
        if quiet or not console.is_terminal:
            return load_kokoro(ref)
        with console.status(f"loading {ref}…"):
            return load_kokoro(ref)
    except EngineError as exc:
        fail(str(exc))


def _play(wav: bytes, player: list[str]) -> None:
    """Play `wav`, or one line and exit 1. Every player here is silent when it plays, and
    ffplay exits 0 even when it opens no audio device, so anything on its stderr fails."""
    name = Path(player[0]).name
    with tempfile.NamedTemporaryFile(suffix=".wav") as handle:
        handle.write(wav)
        handle.flush()
        try:
            done = subprocess.run([*player, handle.name], capture_output=True, text=True)
        except OSError as exc:
            fail(f"{name} could not play the audio ({exc.strerror or exc})", 1)
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    if done.returncode != 0 or said:
        reason = said[-1] if said else f"exit status {done.returncode}"
        fail(f"{name} could not play the audio ({reason}); use -o out.wav", 1)


def speak(
    text: str | None = typer.Argument(None, help="Text to speak; - reads stdin."),
    voice: str | None = typer.Option(
        None, "--voice", "-v", help="Voice pack (af_heart, bm_fable, ...) or OpenAI voice name."
    ),
    speed: float = typer.Option(1.0, "--speed", help="Speaking rate, 0.25 to 4."),
    output: str | None = typer.Option(
        None, "--output", "-o", help="WAV file to write (- for stdout); default: play it."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help=f"Kokoro model directory or cached HF repo id; default: ${MODEL_ENV}.",
    ),
    phonemes: bool = typer.Option(
        False, "--phonemes", help="TEXT is Kokoro phonemes, not text (no phonemizer needed)."
    ),
    list_voices: bool = typer.Option(False, "--list-voices", help="List the voices and exit."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No spinner or summary."),
) -> None:
    """Speak text with Kokoro-82M: write a 24 kHz WAV file, or play it."""
    from mlxcel.engine.audio.codec import write_wav
    from mlxcel.engine.audio.tts import MAX_SPEED, MIN_SPEED, synthesize
    from mlxcel.engine.errors import EngineError

    if not list_voices:
        if text is None:
            fail("missing TEXT (or - to read stdin)")
        text = stdin_text() if text == "-" else utf8_text(text, "TEXT")
        if not text.strip():
            fail("nothing to say: the text is empty")
        if not MIN_SPEED <= speed <= MAX_SPEED:
            fail(f"--speed must be between {MIN_SPEED} and {MAX_SPEED}")
    player = None
    if output is None and not list_voices:
        player = find_player()
        if player is None:
            fail("no audio player found (afplay, pw-play, paplay, aplay, ffplay); use -o out.wav")
    ref = model or process_env.tts_model()
    if ref is None:
        fail(
            f"no text-to-speech model given: pass a Kokoro-82M directory with -m/--model "
            f"or set {MODEL_ENV} (for example an mlx-community/Kokoro-82M-bf16 snapshot)"
        )
    tts = _load(ref, quiet)
    if list_voices:
        for name in sorted(tts.voices):
            print(f"{name}{'  (default)' if name == tts.default_voice else ''}")
        return
    assert text is not None
    try:
        speech = synthesize(tts, text, voice=voice, speed=speed, phonemes=phonemes)
    except EngineError as exc:
        fail(str(exc))
    wav = write_wav(speech.samples, speech.sample_rate)
    if output == "-":
        sys.stdout.buffer.write(wav)
        sys.stdout.buffer.flush()
    elif output is not None:
        try:
            Path(output).write_bytes(wav)
        except OSError as exc:
            fail(f"cannot write {output}: {exc.strerror or exc}")
    if player is not None:
        _play(wav, player)
    if not quiet and output != "-":
        where = output if output is not None else "the speakers"
        print(
            f"mlxcel: {speech.duration:.2f} s of speech ({speech.voice}, "
            f"{speech.sample_rate} Hz) → {where}",
            file=sys.stderr,
        )
