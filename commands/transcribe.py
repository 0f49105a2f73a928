"""Transcribe speech to text with Whisper (default: the shipped Whisper tiny.en)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from mlxcel.config import process_env

from .common import fail

if TYPE_CHECKING:
    from mlxcel.engine.audio.codec import DecodedAudio
    from mlxcel.engine.audio.transcribe import Transcription, TranscriptionOptions
    from mlxcel.engine.audio.whisper import WhisperModel

FORMATS = ("text", "json", "verbose_json", "srt", "vtt")
TASKS = ("transcribe", "translate")
MODEL_ENV = process_env.AUDIO_MODEL
PROGRESS_AFTER_SECONDS = 30.0  # a bar for anything longer than one Whisper window


@dataclass
class _Input:
    name: str  # as given ("-" is stdin)
    stem: str  # for output file names
    audio: DecodedAudio


def _read_inputs(files: list[str]) -> list[_Input]:
    """Every input decoded to 16 kHz mono, before any model loads (bad input fails fast)."""
    from mlxcel.engine.audio.codec import AudioDecodeError, read_audio

    if files.count("-") > 1:
        fail("stdin (-) can be given only once")
    inputs = []
    for name in files:
        try:
            data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
        except IsADirectoryError:
            fail(f"{name} is a directory, not an audio file")
        except OSError as exc:
            fail(f"cannot read {name}: {exc.strerror or exc}")
        label = "stdin" if name == "-" else name
        try:
            audio = read_audio(data, name=label)
        except AudioDecodeError as exc:
            fail(str(exc))
        inputs.append(_Input(name, "stdin" if name == "-" else Path(name).stem, audio))
    return inputs


def _outputs(inputs: list[_Input], output: str | None, fmt: str) -> list[Path | None]:
    """Where each result goes: None for stdout, a file, or files in a directory."""
    from mlxcel.engine.audio.formats import FILE_SUFFIXES

    if output is None or output == "-":
        return [None] * len(inputs)
    if len(inputs) == 1 and not Path(output).is_dir():
        return [Path(output)]
    folder = Path(output)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create directory {output}: {exc.strerror or exc}")
    suffix = FILE_SUFFIXES[fmt]
    paths = [folder / f"{item.stem}{suffix}" for item in inputs]
    if len(set(paths)) != len(paths):
        fail("two inputs share a file name; transcribe them one at a time with -o FILE")
    return list(paths)


def _load(ref: str | None, quiet: bool) -> WhisperModel:
    from rich.console import Console

    from mlxcel.engine.audio.whisper import load_whisper
    from mlxcel.engine.errors import EngineError

    console = Console(stderr=True)
    try:
        if quiet or not console.is_terminal:
            return load_whisper(ref)
        with console.status(f"loading {ref or 'Whisper tiny.en'}…"):
            return load_whisper(ref)
    except EngineError as exc:
        fail(str(exc))


def _run(
    model: WhisperModel, item: _Input, options: TranscriptionOptions, quiet: bool
) -> Transcription:
    """Transcribe one input, with a progress bar on a terminal for long audio."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from mlxcel.engine.audio.transcribe import transcribe
    from mlxcel.engine.errors import EngineError

    console = Console(stderr=True)
    label = "stdin" if item.name == "-" else item.name
    try:
        if quiet or not console.is_terminal:
            return transcribe(model, item.audio.samples, options)
        if item.audio.duration <= PROGRESS_AFTER_SECONDS:
            with console.status(f"transcribing {label}…"):
                return transcribe(model, item.audio.samples, options)
        columns: list[Any] = [
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(label, total=item.audio.duration)
            return transcribe(
                model,
                item.audio.samples,
                options,
                progress=lambda done, _total: bar.update(task, completed=done),
            )
    except EngineError as exc:
        fail(f"{label}: {exc}")


def transcribe(
    files: list[str] = typer.Argument(
        ..., help="Audio files: WAV and FLAC natively, other formats through ffmpeg; - is stdin."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Whisper model: an mlx-whisper or CTranslate2 (faster-whisper) directory, or a "
        f"cached HF repo id; default: ${MODEL_ENV}, else the shipped tiny.en.",
    ),
    language: str | None = typer.Option(
        None, "--language", "-l", help="Spoken language (ISO code such as en); default: detect."
    ),
    task: str = typer.Option("transcribe", "--task", help="transcribe, or translate to English."),
    fmt: str = typer.Option(
        "text", "--format", "-f", help="Output: text, json, verbose_json, srt or vtt."
    ),
    output: str | None = typer.Option(
        None,
        "--output",
        "-o",
        help="Output file (one input) or directory (several inputs); default: stdout.",
    ),
    word_timestamps: bool = typer.Option(
        False,
        "--word-timestamps",
        help="Time every word: a `words` list in verbose_json, one cue per word in srt/vtt.",
    ),
    prompt: str | None = typer.Option(
        None, "--prompt", help="Text that primes spelling and style (names, jargon)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No spinner or progress bar."),
) -> None:
    """Transcribe speech to text with Whisper (default: the shipped Whisper tiny.en)."""
    from mlxcel.engine.audio.formats import render
    from mlxcel.engine.audio.transcribe import TranscriptionOptions, language_code
    from mlxcel.engine.errors import InvalidRequestError

    if fmt not in FORMATS:
        fail(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if task not in TASKS:
        fail(f"unknown task {task!r}; choose transcribe or translate")
    if word_timestamps and fmt in ("text", "json"):
        fail("--word-timestamps needs --format verbose_json, srt or vtt")
    try:
        language = language_code(language)
    except InvalidRequestError as exc:
        fail(str(exc))
    inputs = _read_inputs(files)
    targets = _outputs(inputs, output, fmt)
    whisper = _load(model or process_env.audio_model(), quiet)
    options = TranscriptionOptions(
        language=language,
        task="translate" if task == "translate" else "transcribe",
        prompt=prompt,
        word_timestamps=word_timestamps,
    )
    several = len(inputs) > 1
    for item, target in zip(inputs, targets, strict=True):
        result = _run(whisper, item, options, quiet)
        text = render(result, fmt, words=word_timestamps)
        if not text.endswith("\n"):
            text += "\n"
        if target is not None:
            try:
                target.write_text(text, encoding="utf-8")
            except OSError as exc:
                fail(f"cannot write {target}: {exc.strerror or exc}")
            continue
        if several and fmt in ("text", "srt", "vtt"):
            sys.stdout.write(f"==> {'stdin' if item.name == '-' else item.name} <==\n")
        sys.stdout.write(text)
        sys.stdout.flush()
