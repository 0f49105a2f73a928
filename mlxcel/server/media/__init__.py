"""Media inputs (images, video, audio) taken from requests, under the spec's access policy.

Everything a request names as media (a data URI, an http(s) URL, a `file://` URL or an absolute
path) goes through `sources.load_media`, which applies `policy.MediaPolicy`: remote URLs that
resolve to a non-public address are refused before, during and after connecting; local files
are read only under `--media-path` (local video only under `MLXCEL_VIDEO_DIR_ALLOWLIST`); sizes,
pixels and time are capped. Decoding and its limits are the engine's (`mlxcel.engine.media`,
shared with the CLI); the model libraries downstream only ever get the bytes, decoded objects
or privately staged files, never a user's string.
"""

from mlxcel.engine.media.errors import MediaError
from mlxcel.server.media.policy import MediaPolicy
from mlxcel.server.media.sources import MediaBlob, load_media

__all__ = ["MediaBlob", "MediaError", "MediaPolicy", "load_media"]
