"""Media bytes to model inputs, the same for `mlxcel serve` and the CLI's `--image`/`--video`/
`--audio` files: bounded picture decoding, WAV to 16 kHz, video frames sampled by ffmpeg from
a privately staged file, under one set of size limits. Where bytes may come from (the access
policy for what a request names) is the caller's: the server applies its own.
"""

from mlxcel.engine.media.audio import decode_wav
from mlxcel.engine.media.errors import MediaError
from mlxcel.engine.media.images import decode_image
from mlxcel.engine.media.limits import MediaLimits
from mlxcel.engine.media.video import sample_frames

__all__ = ["MediaError", "MediaLimits", "decode_image", "decode_wav", "sample_frames"]
