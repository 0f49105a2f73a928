"""OpenAI audio routes: /v1/audio/transcriptions, /v1/audio/translations, /v1/audio/speech."""

from mlxcel.server.audio.protocol import MAX_BODY_BYTES
from mlxcel.server.audio.routes import UPLOAD_PATHS, audio_only_router, router

__all__ = ["MAX_BODY_BYTES", "UPLOAD_PATHS", "audio_only_router", "router"]
