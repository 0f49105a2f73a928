"""OpenAI Realtime protocol: the session's configuration, parsed from `session.update` (GA
names, and the beta names where they differ), and the server events, built as the openai
SDK's `RealtimeServerEvent` models read them.

Client bytes are hostile: every field is checked for its type and range here, and a bad
one raises `ClientEventError`, which the session answers with an `error` event.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

AudioFormat = Literal["pcm16", "g711_ulaw", "g711_alaw"]
Modality = Literal["text", "audio"]

PCM_RATE = 24_000
"""The rate of `audio/pcm` (pcm16) in and out, as OpenAI's."""
G711_RATE = 8_000

RATES: dict[AudioFormat, int] = {"pcm16": PCM_RATE, "g711_ulaw": G711_RATE, "g711_alaw": G711_RATE}
BYTES_PER_SAMPLE: dict[AudioFormat, int] = {"pcm16": 2, "g711_ulaw": 1, "g711_alaw": 1}
_GA_FORMATS: dict[str, AudioFormat] = {
    "audio/pcm": "pcm16",
    "audio/pcmu": "g711_ulaw",
    "audio/pcma": "g711_alaw",
}
_GA_NAMES = {value: key for key, value in _GA_FORMATS.items()}

DEFAULT_INSTRUCTIONS = (
    "You are a helpful voice assistant. Answer briefly, in plain spoken sentences."
)
MAX_INSTRUCTIONS_CHARS = 100_000
MAX_TOOLS = 128


def new_id(prefix: str) -> str:
    """A fresh id such as `item_3f9a...` (`event`, `item`, `resp`, `sess`, `call`)."""
    return f"{prefix}_{secrets.token_hex(10)}"


class ClientEventError(Exception):
    """A client event the session refuses: answered with an `error` event, session kept."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True)
class TurnDetection:
    """`server_vad`: speech start/stop by voice activity, a turn committed after the silence."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def wire(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


@dataclass(frozen=True)
class SessionConfig:
    """What a session is set to; `session.update` replaces the fields it names."""

    instructions: str = DEFAULT_INSTRUCTIONS
    voice: str = "alloy"
    speed: float = 1.0
    input_format: AudioFormat = "pcm16"
    output_format: AudioFormat = "pcm16"
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    output_modalities: tuple[Modality, ...] = ("audio",)
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    max_output_tokens: int | None = None  # None: "inf" (the server's limit)
    temperature: float | None = None  # beta only; None: the server's default

    @property
    def speaks(self) -> bool:
        """Whether answers are spoken (else text only)."""
        return "audio" in self.output_modalities

    def wire(self, session_id: str, model: str) -> dict[str, Any]:
        """The session object of `session.created` / `session.updated`."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": audio_format_wire(self.input_format),
                    "transcription": {"model": "whisper-1"},
                    "turn_detection": (self.turn_detection.wire() if self.turn_detection else None),
                },
                "output": {
                    "format": audio_format_wire(self.output_format),
                    "voice": self.voice,
                    "speed": self.speed,
                },
            },
            "tools": list(self.tools),
            "tool_choice": self.tool_choice,
            "max_output_tokens": (
                "inf" if self.max_output_tokens is None else self.max_output_tokens
            ),
        }


def audio_format_wire(fmt: AudioFormat) -> dict[str, Any]:
    """GA's format object of `fmt`."""
    wire: dict[str, Any] = {"type": _GA_NAMES[fmt]}
    if fmt == "pcm16":
        wire["rate"] = PCM_RATE
    return wire


# ------------------------------------------------------------------- parsing


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ClientEventError(f"{param} must be an object", param=param)
    return value


def _string(value: Any, param: str, *, limit: int = 256) -> str:
    if not isinstance(value, str):
        raise ClientEventError(f"{param} must be a string", param=param)
    if len(value) > limit:
        raise ClientEventError(f"{param} is longer than {limit} characters", param=param)
    return value


def _number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ClientEventError(f"{param} must be a number from {low} to {high}", param=param)
    return float(value)


def _integer(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ClientEventError(f"{param} must be an integer from {low} to {high}", param=param)
    return value


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise ClientEventError(f"{param} must be true or false", param=param)
    return value


def parse_audio_format(value: Any, param: str) -> AudioFormat:
    """GA `{"type": "audio/pcm", "rate": 24000}` / `audio/pcmu` / `audio/pcma`, or beta
    `pcm16` / `g711_ulaw` / `g711_alaw`."""
    if isinstance(value, str) and value in RATES:
        return value  # type: ignore[return-value]
    if isinstance(value, dict):
        kind = value.get("type", "audio/pcm")
        fmt = _GA_FORMATS.get(kind) if isinstance(kind, str) else None
        if fmt is not None:
            rate = value.get("rate")
            if fmt == "pcm16" and rate is not None and rate != PCM_RATE:
                raise ClientEventError(
                    f"{param}.rate: only {PCM_RATE} Hz PCM is supported", param=f"{param}.rate"
                )
            return fmt
    raise ClientEventError(
        f"{param} must be audio/pcm (24 kHz), audio/pcmu or audio/pcma"
        " (beta: pcm16, g711_ulaw, g711_alaw)",
        param=param,
    )


def parse_turn_detection(
    value: Any, param: str, current: TurnDetection | None
) -> TurnDetection | None:
    """`null` (manual turns) or `{"type": "server_vad", ...}` over the current values."""
    if value is None:
        return None
    body = _object(value, param)
    kind = body.get("type", "server_vad")
    if kind != "server_vad":
        raise ClientEventError(
            f"{param}.type {str(kind)[:40]!r} is not supported; use server_vad or null",
            param=f"{param}.type",
            code="unsupported_value",
        )
    base = current or TurnDetection()
    changes: dict[str, Any] = {}
    if body.get("threshold") is not None:
        changes["threshold"] = _number(body["threshold"], f"{param}.threshold", 0.0, 1.0)
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        if body.get(name) is not None:
            changes[name] = _integer(body[name], f"{param}.{name}", 0, 10_000)
    for name in ("create_response", "interrupt_response"):
        if body.get(name) is not None:
            changes[name] = _bool(body[name], f"{param}.{name}")
    return replace(base, **changes)


def _modalities(value: Any, param: str) -> tuple[Modality, ...]:
    if not isinstance(value, list) or not value or not all(v in ("text", "audio") for v in value):
        raise ClientEventError(f"{param} must be ['audio'] or ['text']", param=param)
    return ("audio",) if "audio" in value else ("text",)


def _tools(value: Any, param: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ClientEventError(f"{param} must be a list of at most {MAX_TOOLS} tools", param=param)
    tools = []
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        body = _object(tool, where)
        if body.get("type", "function") != "function":
            raise ClientEventError(
                f"{where}.type: only function tools are supported", param=f"{where}.type"
            )
        name = _string(body.get("name"), f"{where}.name", limit=64)
        if not name:
            raise ClientEventError(f"{where}.name must not be empty", param=f"{where}.name")
        entry: dict[str, Any] = {"type": "function", "name": name}
        if body.get("description") is not None:
            entry["description"] = _string(body["description"], f"{where}.description", limit=8192)
        if body.get("parameters") is not None:
            entry["parameters"] = _object(body["parameters"], f"{where}.parameters")
        tools.append(entry)
    return tuple(tools)


def _tool_choice(value: Any, param: str) -> str | dict[str, Any]:
    if value in ("auto", "none", "required"):
        return str(value)
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "name": _string(value.get("name"), f"{param}.name", limit=64)}
    raise ClientEventError(
        f"{param} must be auto, none, required or {{type: function, name}}", param=param
    )


def _max_tokens(value: Any, param: str) -> int | None:
    if value == "inf":
        return None
    return _integer(value, param, 1, 1_000_000)


def apply_session_update(config: SessionConfig, session: Any) -> SessionConfig:
    """`config` with the fields of a `session.update`'s `session` object (GA or beta)."""
    body = _object(session, "session")
    kind = body.get("type", "realtime")
    if kind != "realtime":
        raise ClientEventError(
            "session.type: only realtime (speech-to-speech) sessions are served",
            param="session.type",
            code="unsupported_value",
        )
    changes: dict[str, Any] = {}
    if "instructions" in body:
        changes["instructions"] = _string(
            body["instructions"], "session.instructions", limit=MAX_INSTRUCTIONS_CHARS
        )
    for name in ("output_modalities", "modalities"):
        if body.get(name) is not None:
            changes["output_modalities"] = _modalities(body[name], f"session.{name}")
    audio = _object(body.get("audio") or {}, "session.audio")
    audio_in = _object(audio.get("input") or {}, "session.audio.input")
    audio_out = _object(audio.get("output") or {}, "session.audio.output")
    formats = (
        ("input_format", audio_in.get("format"), "session.audio.input.format"),
        ("input_format", body.get("input_audio_format"), "session.input_audio_format"),
        ("output_format", audio_out.get("format"), "session.audio.output.format"),
        ("output_format", body.get("output_audio_format"), "session.output_audio_format"),
    )
    for key, value, name in formats:
        if value is not None:
            changes[key] = parse_audio_format(value, name)
    for holder, name in ((audio_in, "session.audio.input"), (body, "session")):
        if "turn_detection" in holder:
            changes["turn_detection"] = parse_turn_detection(
                holder["turn_detection"], f"{name}.turn_detection", config.turn_detection
            )
    for value, name in ((audio_out.get("voice"), "session.audio.output.voice"),
                        (body.get("voice"), "session.voice")):  # fmt: skip
        if value is not None:
            changes["voice"] = _string(value, name, limit=64)
    if audio_out.get("speed") is not None:
        changes["speed"] = _number(audio_out["speed"], "session.audio.output.speed", 0.25, 4.0)
    if body.get("tools") is not None:
        changes["tools"] = _tools(body["tools"], "session.tools")
    if body.get("tool_choice") is not None:
        changes["tool_choice"] = _tool_choice(body["tool_choice"], "session.tool_choice")
    for name in ("max_output_tokens", "max_response_output_tokens"):
        if body.get(name) is not None:
            changes["max_output_tokens"] = _max_tokens(body[name], f"session.{name}")
    if body.get("temperature") is not None:
        changes["temperature"] = _number(body["temperature"], "session.temperature", 0.0, 2.0)
    return replace(config, **changes)


# ------------------------------------------------------------------- server events


def event(kind: str, **fields: Any) -> dict[str, Any]:
    """A server event of type `kind` with a fresh `event_id`."""
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: ClientEventError, client_event_id: str | None = None) -> dict[str, Any]:
    """`error` for a refused client event (its `event_id`, when it had a string one)."""
    return event(
        "error",
        error={
            "type": "invalid_request_error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "event_id": client_event_id,
        },
    )


def server_error_event(
    message: str, kind: str = "server_error", code: str | None = None
) -> dict[str, Any]:
    """`error` for a failure on the server's side (a model, a full queue...)."""
    return event("error", error={"type": kind, "code": code, "message": message, "param": None})


MAX_METADATA_PAIRS = 16


def response_metadata(body: Any) -> dict[str, str] | None:
    """`response.metadata`: at most 16 string pairs, keys up to 64 characters and values up
    to 512 (OpenAI's limits), echoed on the response."""
    if body is None:
        return None
    param = "response.metadata"
    if not isinstance(body, dict) or len(body) > MAX_METADATA_PAIRS:
        raise ClientEventError(
            f"{param} must be an object of at most {MAX_METADATA_PAIRS} pairs", param=param
        )
    for key, value in body.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            raise ClientEventError(
                f"{param} keys must be at most 64 characters and values strings of at most 512",
                param=param,
            )
    return dict(body)
