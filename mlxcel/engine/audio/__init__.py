"""Audio: speech to text (Whisper through mlx-whisper) and text to speech (Kokoro through
mlx-audio). Importing this package loads no ML library; each function imports what it needs.

- `codec`: audio file bytes → float32 samples (WAV natively, FLAC via soundfile, else ffmpeg),
  samples → WAV.
- `ct2`: CTranslate2 (faster-whisper) checkpoints → mlx-whisper's layout.
- `whisper`: resolve, convert (cached in the model store) and load Whisper models.
- `cpu_whisper`: Whisper's encoder and decoder in numpy (the fast path on the CPU).
- `lazy_timing`: mlx-whisper's word-timestamp module (numba, scipy.signal) imported on use.
- `transcribe` / `formats`: run a transcription; render it as text, json, verbose_json, srt, vtt.
- `phonemize` / `tts`: offline phonemes and Kokoro synthesis.
"""

from mlxcel.engine.audio import lazy_timing

lazy_timing.install()
