"""`/v1/realtime`: time from the end of the user's speech to the first audio delta of the
answer, and where it goes, in one run.

A server with a chat model (SmolLM2 by default), Whisper (`--audio-model default`) and a
Kokoro checkpoint (`--tts-model`; default: the tests' tiny random Kokoro, whose speed is
not the real Kokoro-82M's) runs a `server_vad` session. Each round sends Piper's reading of
a question, then silence in real time (100 ms every 100 ms) as a microphone would, and
timestamps the events as they arrive:

- VAD: end of speech → `input_audio_buffer.speech_stopped` (the silence the turn needs,
  `silence_duration_ms`, plus a frame);
- STT: → `conversation.item.input_audio_transcription.completed`;
- LLM first sentence: → the transcript delta that completes the first sentence (split as the
  server splits it);
- TTS first sentence: → the first `response.output_audio.delta`.

    .venv/bin/python bench/realtime_latency.py [-m MODEL] [--tts-model DIR] [-r ROUNDS] [--baseline]

`--baseline` runs the same rounds first against a server on MLX's own CPU convolutions for
Kokoro (`MLXCEL_KOKORO_CONV=mlx`, as before they became matrix products) and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import numpy as np  # noqa: E402
import websockets  # noqa: E402
from _common import load_note, median, mlxcel_server, spread  # noqa: E402

from mlxcel.engine.audio.codec import resample  # noqa: E402
from mlxcel.engine.voice.sentences import SentenceChunker  # noqa: E402

QUESTION = "What is the capital of France?"
RATE = 24_000
CHUNK = RATE // 10 * 2  # 100 ms of PCM16
STAGES = ("vad", "stt", "llm_first_sentence", "tts_first_sentence")


def _question_pcm() -> bytes:
    from fixtures.audio import synthesize_speech

    samples, rate = synthesize_speech(QUESTION)
    audio = resample(samples.astype(np.float32) / 32768.0, rate, RATE)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def _round(url: str, speech: bytes, silence_ms: int) -> dict[str, float]:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.recv()  # session.created
        session = {"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": silence_ms}}}}  # fmt: skip
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        lead = bytes(RATE // 2 * 2)  # 500 ms of silence before speaking
        audio = lead + speech
        for start in range(0, len(audio), CHUNK):
            piece = _b64(audio[start : start + CHUNK])
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
        end_of_speech = time.perf_counter()
        marks: dict[str, float] = {}
        chunker = SentenceChunker()

        async def microphone() -> None:
            silence = _b64(bytes(CHUNK))
            while True:
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
                await asyncio.sleep(0.1)

        mic = asyncio.ensure_future(microphone())
        try:
            while "first_audio" not in marks:
                event = json.loads(await asyncio.wait_for(ws.recv(), 300))
                now, kind = time.perf_counter(), event["type"]
                if kind == "input_audio_buffer.speech_stopped":
                    marks.setdefault("stopped", now)
                elif kind == "conversation.item.input_audio_transcription.completed":
                    marks.setdefault("transcribed", now)
                elif kind == "response.output_audio_transcript.delta":
                    marks["last_text"] = now
                    if chunker.feed(event["delta"]):
                        marks.setdefault("sentence", now)
                elif kind == "response.output_audio.delta":
                    # One sentence in all: it was complete with the last text (the end).
                    marks.setdefault("sentence", marks["last_text"])
                    marks["first_audio"] = now
                elif kind == "error":
                    raise RuntimeError(event["error"]["message"])
        finally:
            mic.cancel()
    return {
        "vad": marks["stopped"] - end_of_speech,
        "stt": marks["transcribed"] - marks["stopped"],
        "llm_first_sentence": marks["sentence"] - marks["transcribed"],
        "tts_first_sentence": marks["first_audio"] - marks["sentence"],
        "total": marks["first_audio"] - end_of_speech,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None, help="chat model (default: SmolLM2)")
    parser.add_argument("--tts-model", default=None, help="Kokoro dir (default: tiny fixture)")
    parser.add_argument("-r", "--rounds", type=int, default=3)
    parser.add_argument("--silence-ms", type=int, default=500)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="first a server with MLX's own CPU convolutions for Kokoro (MLXCEL_KOKORO_CONV=mlx)",
    )
    args = parser.parse_args()
    from mlxcel.engine.loading.default_model import default_model_path

    model = args.model or str(default_model_path())
    tts = args.tts_model
    if tts is None:
        from fixtures.audio import tiny_kokoro_dir

        tts = str(tiny_kokoro_dir())
    speech = _question_pcm()
    extra = ["--audio-model", "default", "--tts-model", tts, "--temp", "0", "-n", "64"]
    runs = {"": {}} if not args.baseline else {"MLX's convolutions": {"MLXCEL_KOKORO_CONV": "mlx"}}
    if args.baseline:
        runs["matrix-product convolutions"] = {}
    print(f"end of speech -> first audio delta, {args.rounds} rounds ({load_note()})")
    totals: dict[str, float] = {}
    for label, env in runs.items():
        rounds: list[dict[str, float]] = []
        with mlxcel_server(model, *extra, env=env).start() as server:
            url = server.url.replace("http://", "ws://") + "/v1/realtime"
            asyncio.run(_round(url, speech, args.silence_ms))  # warm-up (first prompt)
            for _ in range(args.rounds):
                rounds.append(asyncio.run(_round(url, speech, args.silence_ms)))
        if label:
            print(f" {label} (Kokoro on the CPU):")
        total = totals[label] = median(r["total"] for r in rounds)
        for stage in (*STAGES, "total"):
            values = [r[stage] * 1000 for r in rounds]
            share = median(r[stage] for r in rounds) / total if stage != "total" else 1.0
            print(
                f"  {stage:20s} median {median(values):7.0f} ms  ({spread(values)})  {share:5.0%}"
            )
    if args.baseline:
        before, after = totals.values()
        print(f" end of speech -> first audio: {before / after:.2f}x faster than with MLX's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
