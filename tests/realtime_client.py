"""A small Realtime test client over `websockets`: sends client events, reads server events
(each one checked against the openai SDK's `RealtimeServerEvent` models, strictly), and
the Piper speech the tests speak, as 24 kHz PCM16."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
from typing import Any

import numpy as np
import websockets
from fixtures.audio import SENTENCE, synthesize_speech
from pydantic import TypeAdapter

from mlxcel.engine.audio.codec import resample

PCM_RATE = 24_000


@functools.cache
def _server_events() -> TypeAdapter[Any]:
    from openai.types.realtime import RealtimeServerEvent

    return TypeAdapter(RealtimeServerEvent)


def check_event(event: dict[str, Any]) -> None:
    """Raise unless the openai SDK's models accept `event` as a server event."""
    _server_events().validate_python(event)


@functools.cache
def speech_pcm(text: str = SENTENCE) -> bytes:
    """`text` read by Piper, as 24 kHz little-endian PCM16."""
    samples, rate = synthesize_speech(text)
    audio = resample(samples.astype(np.float32) / 32768.0, rate, PCM_RATE)
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def silence_pcm(seconds: float) -> bytes:
    return bytes(int(PCM_RATE * seconds) * 2)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def ws_url(http_url: str, path: str = "/v1/realtime?model=voice") -> str:
    return http_url.replace("http://", "ws://", 1) + path


class Client:
    """One connection: `send` events, `until` a type arrives (all events kept in `events`)."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.events: list[dict[str, Any]] = []

    async def send(self, kind: str, **fields: Any) -> None:
        await self.connection.send(json.dumps({"type": kind, **fields}))

    async def recv(self, timeout: float = 120.0) -> dict[str, Any]:
        event = json.loads(await asyncio.wait_for(self.connection.recv(), timeout))
        check_event(event)
        self.events.append(event)
        return event

    async def until(self, kind: str, timeout: float = 180.0) -> dict[str, Any]:
        """Events up to the first of type `kind` (returned)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = await self.recv(max(0.1, deadline - loop.time()))
            if event["type"] == kind:
                return event

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def index(self, kind: str, last: bool = False) -> int:
        positions = [i for i, e in enumerate(self.events) if e["type"] == kind]
        return positions[-1] if last else positions[0]

    async def speak(self, pcm: bytes, chunk_ms: int = 100) -> None:
        """Append `pcm` in chunks as a microphone would (without waiting in real time)."""
        step = PCM_RATE * chunk_ms // 1000 * 2
        for start in range(0, len(pcm), step):
            await self.send("input_audio_buffer.append", audio=b64(pcm[start : start + step]))


def connect(url: str, key: str | None, **kwargs: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return websockets.connect(url, additional_headers=headers, max_size=None, **kwargs)
