"""Transcriptions as OpenAI's response formats: text, json, verbose_json, srt, vtt."""

from __future__ import annotations

import json
from typing import Any

from mlxcel.engine.audio.transcribe import Segment, Transcription, language_name
from mlxcel.engine.errors import InvalidRequestError

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
MEDIA_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}
FILE_SUFFIXES = {
    "json": ".json",
    "verbose_json": ".json",
    "text": ".txt",
    "srt": ".srt",
    "vtt": ".vtt",
}


def check_format(fmt: str) -> str:
    """`fmt` if it is a supported response format, else InvalidRequestError listing them."""
    if fmt not in RESPONSE_FORMATS:
        raise InvalidRequestError(
            f"unsupported response_format {fmt!r}; supported: {', '.join(RESPONSE_FORMATS)}"
        )
    return fmt


def as_json(t: Transcription) -> dict[str, Any]:
    """OpenAI's `json` body."""
    return {"text": t.text}


def as_verbose_json(
    t: Transcription, *, segments: bool = True, words: bool | None = None
) -> dict[str, Any]:
    """OpenAI's `verbose_json` body; `words` defaults to "when they were computed"."""
    body: dict[str, Any] = {
        "task": t.task,
        "language": language_name(t.language),
        "duration": t.duration,
        "text": t.text,
    }
    if segments:
        body["segments"] = [_segment(s) for s in t.segments]
    all_words = t.words
    if words or (words is None and all_words):
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in all_words]
    return body


def as_srt(t: Transcription, *, words: bool = False) -> str:
    """SubRip subtitles: one cue per segment, or per word with `words` (when computed)."""
    cues = []
    for number, (start, end, text) in enumerate(_cues(t, words), start=1):
        cues.append(f"{number}\n{timestamp(start, ',')} --> {timestamp(end, ',')}\n{text}\n")
    return "\n".join(cues)


def as_vtt(t: Transcription, *, words: bool = False) -> str:
    """WebVTT subtitles: one cue per segment, or per word with `words` (when computed)."""
    cues = ["WEBVTT\n"]
    for start, end, text in _cues(t, words):
        cues.append(f"{timestamp(start, '.')} --> {timestamp(end, '.')}\n{text}\n")
    return "\n".join(cues)


def render(t: Transcription, fmt: str, *, words: bool | None = None) -> str:
    """The transcription as the text of one response body or output file."""
    check_format(fmt)
    if fmt == "text":
        return t.text + "\n"
    if fmt == "srt":
        return as_srt(t, words=bool(words))
    if fmt == "vtt":
        return as_vtt(t, words=bool(words))
    body = as_json(t) if fmt == "json" else as_verbose_json(t, words=words)
    return json.dumps(body, ensure_ascii=False)


def timestamp(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (SRT, decimal=",") or HH:MM:SS.mmm (VTT, decimal=".")."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def _cues(t: Transcription, words: bool) -> list[tuple[float, float, str]]:
    if words and t.words:
        return [(w.start, w.end, w.word) for w in t.words if w.word]
    return [(s.start, s.end, s.text.strip()) for s in t.segments if s.text.strip()]


def _segment(s: Segment) -> dict[str, Any]:
    return {
        "id": s.id,
        "seek": s.seek,
        "start": s.start,
        "end": s.end,
        "text": s.text,
        "tokens": s.tokens,
        "temperature": s.temperature,
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    }
