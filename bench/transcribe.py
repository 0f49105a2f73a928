"""Whisper tiny.en transcription: mlxcel vs mlx-whisper's own `transcribe`, in one run.

Two recordings made with the Piper voice the tests use: a 2.8 s sentence and a ~64 s
meeting (two 30-second windows and a bit). Both are written once as 16 kHz WAV files so
every path reads exactly the same samples. For each recording it times:

- in process, warm model: `mlxcel.engine.audio.transcribe` (the default numpy forward on
  the CPU; with --mlx-forward also `forward="mlx"`, mlxcel's previous path) against
  `mlx_whisper.transcribe` on the same converted checkpoint in float32 (fp16=False: float16
  is slower on the CPU);
- end to end, a fresh process each time: `mlxcel transcribe FILE -q` against a Python
  process that imports mlx_whisper, reads the WAV and calls `mlx_whisper.transcribe`.

It prints seconds (median of the repetitions, and the range), the real-time factor
(audio seconds / wall seconds) and the ratio mlxcel / mlx-whisper, the word error rate of
each transcript, and which BLAS ran (MLX's and numpy's). The machine's load is printed too:
on a shared machine absolute figures move a lot; the ratios are measured side by side.

    .venv/bin/python bench/transcribe.py [-r REPS] [--skip-cli] [--mlx-forward]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
OUT = Path(os.environ.get("TMPDIR", "/tmp")) / "mlxcel-bench" / "transcribe"

MLX_WHISPER_SCRIPT = """
import sys, wave
import mlxcel.engine  # the same BLAS under MLX as mlxcel has (OpenBLAS where it is found)
import numpy as np
import mlx_whisper
with wave.open(sys.argv[1]) as f:
    pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
audio = pcm.astype(np.float32) / 32768.0
print(mlx_whisper.transcribe(audio, path_or_hf_repo=sys.argv[2], fp16=False)["text"].strip())
"""


def recordings() -> list[tuple[str, Path, str]]:
    """(label, 16 kHz WAV path, reference text) for the short and the long recording."""
    from fixtures.audio import SENTENCE, long_speech_wav, speech_wav, write_pcm16_wav

    from mlxcel.engine.audio.codec import read_audio

    OUT.mkdir(parents=True, exist_ok=True)
    items = []
    for label, (source, text) in (
        ("clip", (speech_wav(), SENTENCE)),
        ("long", long_speech_wav()),
    ):
        target = OUT / f"{label}-16k.wav"
        if not target.is_file():
            samples = read_audio(source.read_bytes()).samples
            write_pcm16_wav(target, (samples.clip(-1, 1) * 32767).round(), 16_000)
        (OUT / f"{label}.txt").write_text(text)
        items.append((label, target, text))
    return items


def timed(fn: Callable[[], str], reps: int) -> tuple[list[float], str]:
    times, text = [], ""
    for _ in range(reps):
        started = time.perf_counter()
        text = fn()
        times.append(time.perf_counter() - started)
    return times, text


def describe(label: str, times: list[float], audio_s: float, text: str, ref: str) -> float:
    from fixtures.audio import word_error_rate

    median = statistics.median(times)
    print(
        f"  {label:34s} {median:7.2f} s  [{min(times):.2f}-{max(times):.2f}]"
        f"  {audio_s / median:6.1f}x real time  WER {word_error_rate(ref, text):.3f}"
    )
    return median


def blas_line() -> str:
    import numpy as np

    from mlxcel.engine.blas import blas_in_use

    config: Any = np.show_config(mode="dicts") if hasattr(np, "show_config") else {}
    numpy_blas = config.get("Build Dependencies", {}).get("blas", {}).get("name", "?")
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "1 (mlxcel's default on <= 4 cores)")
    return f"MLX: {blas_in_use()}; numpy: {numpy_blas}; OpenBLAS threads: {threads}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("--skip-cli", action="store_true", help="in-process figures only")
    parser.add_argument(
        "--mlx-forward", action="store_true", help="also time mlxcel with forward=mlx"
    )
    args = parser.parse_args()

    import mlxcel.engine  # noqa: F401  (first: it puts OpenBLAS under MLX, before mlx.core)

    import mlx_whisper  # isort: skip
    import numpy as np

    from mlxcel.engine.audio.codec import read_audio
    from mlxcel.engine.audio.transcribe import transcribe
    from mlxcel.engine.audio.whisper import load_whisper

    items = recordings()
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    print(blas_line())
    fast = load_whisper(None)
    previous = load_whisper(None, forward="mlx") if args.mlx_forward else None
    model_dir = str(fast.path)
    print(f"model: {fast.name} ({model_dir}), mlxcel forward: {fast.forward}")

    for label, path, ref in items:
        audio = read_audio(path.read_bytes()).samples
        audio_s = len(audio) / 16_000
        print(f"\n{label}: {audio_s:.1f} s of speech, {args.reps} repetitions")
        print(" in process (model loaded and warmed):")

        def ours(model: Any = fast, samples: np.ndarray = audio) -> str:
            return transcribe(model, samples).text

        def theirs(samples: np.ndarray = audio) -> str:
            result = mlx_whisper.transcribe(samples, path_or_hf_repo=model_dir, fp16=False)
            return str(result["text"]).strip()

        ours()  # warm-up: first-call work (tokenizer, mel filters) is not timed
        theirs()
        t_ours, text_ours = timed(ours, args.reps)
        t_theirs, text_theirs = timed(theirs, args.reps)
        m_ours = describe("mlxcel (numpy forward)", t_ours, audio_s, text_ours, ref)
        m_theirs = describe("mlx_whisper.transcribe (float32)", t_theirs, audio_s, text_theirs, ref)
        print(f"  ratio mlxcel / mlx_whisper: {m_theirs / m_ours:.2f}x faster")
        if previous is not None:
            t_prev, text_prev = timed(lambda: ours(previous), args.reps)
            m_prev = describe("mlxcel (forward=mlx)", t_prev, audio_s, text_prev, ref)
            print(f"  ratio mlxcel numpy / mlx forward: {m_prev / m_ours:.2f}x faster")
        if args.skip_cli:
            continue
        print(" end to end (a fresh process each run):")
        cli = [str(ROOT / ".venv" / "bin" / "mlxcel"), "transcribe", str(path), "-q"]
        if not Path(cli[0]).exists():
            cli = [sys.executable, "-m", "mlxcel", "transcribe", str(path), "-q"]
        plain = [sys.executable, "-c", MLX_WHISPER_SCRIPT, str(path), model_dir]

        def run(command: list[str]) -> Callable[[], str]:
            def go() -> str:
                done = subprocess.run(command, capture_output=True, text=True, check=True)
                return done.stdout.strip()

            return go

        c_ours, cli_text = timed(run(cli), args.reps)
        c_theirs, plain_text = timed(run(plain), args.reps)
        e_ours = describe("mlxcel transcribe", c_ours, audio_s, cli_text, ref)
        e_theirs = describe("python + mlx_whisper.transcribe", c_theirs, audio_s, plain_text, ref)
        print(f"  ratio mlxcel / mlx_whisper: {e_theirs / e_ours:.2f}x faster")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
