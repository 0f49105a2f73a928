"""Check a model directory's safetensors files before a loader reads them.

MLX's reader raises a RuntimeError on a cut-off or corrupt file (an interrupted download,
a full disk) in the middle of the loader; the safetensors library reads each file's header
and checks that its tensors cover the file exactly, without loading any of them.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from mlxcel.engine.errors import ModelLoadError

_PREFIX = "Error while deserializing header: "


def check_safetensors(path: Path, *, name: str) -> None:
    """Raise ModelLoadError naming the first *.safetensors file in `path` that is truncated
    or corrupt (`name` names the model)."""
    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy"):
                pass
        except (SafetensorError, OSError) as exc:
            detail = str(exc).removeprefix(_PREFIX)
            raise ModelLoadError(f"{name}: {file.name} is truncated or corrupt ({detail})") from exc
