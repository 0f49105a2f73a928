"""`/v1/realtime`: OpenAI's Realtime protocol over a WebSocket, as a cascade of the server's
speech-to-text, chat and text-to-speech models.

- `protocol`: the session configuration (`session.update`) and the server events;
- `audio_wire`: base64 PCM16 / G.711 to and from the models' samples;
- `input_buffer`: the bounded input audio buffer and its turn detection;
- `conversation`: items, and the chat turns they become;
- `response`: one response, streamed from the chat core and spoken sentence by sentence;
- `session`: the state machine of one connection;
- `routes`: the WebSocket route (auth, 501 when a model is missing, limits).
"""

from mlxcel.server.realtime.routes import router

__all__ = ["router"]
