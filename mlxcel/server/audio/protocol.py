"""Wire shapes of OpenAI's audio API: the speech JSON body and the transcription form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from mlxcel.engine.audio.formats import RESPONSE_FORMATS
from mlxcel.server.errors import bad_request

MAX_UPLOAD_BYTES = 25 * 1024 * 1024
"""OpenAI's limit for one uploaded audio file (25 MiB)."""
FORM_OVERHEAD_BYTES = 1024 * 1024
"""Room for the other form fields and multipart framing around the file."""
MAX_BODY_BYTES = MAX_UPLOAD_BYTES + FORM_OVERHEAD_BYTES

SPEECH_FORMATS = ("wav", "pcm")
SPEECH_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}
GRANULARITIES = ("word", "segment")


class SpeechRequest(BaseModel):
    """POST /v1/audio/speech. `response_format` defaults to wav (mp3 is not produced)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str
    voice: str | None = None
    response_format: str | None = None
    speed: float = 1.0
    instructions: str | None = None  # accepted; Kokoro has no instruction input
    stream_format: str | None = None

    def audio_format(self) -> str:
        """The output format, 400 unless it is one this server writes."""
        if self.stream_format not in (None, "audio"):
            raise bad_request(f"unsupported stream_format {self.stream_format!r}; supported: audio")
        fmt = (self.response_format or "wav").lower()
        if fmt not in SPEECH_FORMATS:
            raise bad_request(
                f"unsupported response_format {fmt!r}; supported: {', '.join(SPEECH_FORMATS)}"
            )
        return fmt


@dataclass
class TranscriptionForm:
    """The fields of a transcription or translation form (the file read separately)."""

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float | None = None
    timestamp_granularities: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, form: Any, *, translation: bool = False) -> TranscriptionForm:
        """Read and check the text fields of `form` (a starlette FormData); 400 on bad ones."""
        if _text(form, "stream") in ("true", "1"):
            raise bad_request("streaming transcriptions are not supported; omit stream")
        fmt = (_text(form, "response_format") or "json").lower()
        if fmt not in RESPONSE_FORMATS:
            raise bad_request(
                f"unsupported response_format {fmt!r}; supported: {', '.join(RESPONSE_FORMATS)}"
            )
        granularities = [
            str(value).strip().lower()
            for key in ("timestamp_granularities[]", "timestamp_granularities")
            for value in form.getlist(key)
            if str(value).strip()
        ]
        for value in granularities:
            if value not in GRANULARITIES:
                raise bad_request(
                    f"unsupported timestamp granularity {value!r}; supported: word, segment"
                )
        if granularities and fmt != "verbose_json":
            raise bad_request("timestamp_granularities requires response_format=verbose_json")
        return cls(
            model=_text(form, "model"),
            language=None if translation else _text(form, "language"),
            prompt=_text(form, "prompt"),
            response_format=fmt,
            temperature=_temperature(_text(form, "temperature")),
            timestamp_granularities=granularities,
        )

    @property
    def words(self) -> bool:
        """Whether word timestamps were asked for."""
        return "word" in self.timestamp_granularities

    @property
    def segments(self) -> bool:
        """Whether segments go in verbose_json (the default, or asked for by name)."""
        return not self.timestamp_granularities or "segment" in self.timestamp_granularities


def _text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None or not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def _temperature(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(f"temperature must be a number, not {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise bad_request("temperature must be between 0 and 1")
    return value
