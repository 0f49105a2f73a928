"""OpenAI audio routes: /v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech."""

from mlxcel.server.audio.routes import audio_only_router, router

__all__ = ["audio_only_router", "router"]
