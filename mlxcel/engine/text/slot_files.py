"""Slot save files (llama-server's `--slot-save-path DIR`): the KV cache a slot holds, as a
file in DIR that a later `restore` puts back into the prompt cache.

A file is mlx-lm's `save_prompt_cache` format (safetensors) with mlxcel's metadata: the
tokens the cache holds, the KV cache type and the model, so a file is restored only into
a server of the same model and type. File names are confined to DIR: empty names, path
separators, `.`/`..`, leading or trailing spaces, a trailing dot, control characters, more
than 255 bytes and symbolic links are refused. A save is written to a temporary name and
renamed into place; it writes the prompt-cache entry's evaluated arrays as they are (when
a longer sequence extended the slot's tokens, the entry's extra tokens too, cut off at
restore), so no MLX work runs outside the engine thread. A restore reads the file's header
(no MLX) to check it and answer; the engine thread loads the arrays (mlx-lm's
`load_prompt_cache`) before its next prompt-cache lookup.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.text.prompt_cache import PromptCache

_FORMAT = "mlxcel-slot-v1"
_MAX_HEADER = 64 << 20


class SlotFileError(InvalidRequestError):
    """A slot action the client asked for cannot be done (bad name, file, or state)."""


@dataclass(frozen=True)
class SlotFileResult:
    """What a save or a restore did: the file, its tokens and bytes, the time it took."""

    filename: str
    n_tokens: int
    n_bytes: int
    ms: float


def slot_path(directory: Path, filename: object) -> Path:
    """`directory / filename` for a plain file name (SlotFileError for anything else)."""
    if not isinstance(filename, str) or not filename:
        raise SlotFileError("Invalid filename")
    bad = (
        filename in (".", "..")
        or "/" in filename
        or "\\" in filename
        or filename != filename.strip()
        or filename.endswith(".")
        or len(filename.encode("utf-8", "surrogatepass")) > 255
        or any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in filename)
        or filename.startswith("\ufeff")
    )
    if bad:
        raise SlotFileError("Invalid filename")
    path = directory / filename
    if path.is_symlink():
        raise SlotFileError("Invalid filename: symbolic links are refused")
    if path.resolve().parent != directory.resolve():
        raise SlotFileError("Invalid filename")
    return path


def _read_header(path: Path) -> tuple[dict[str, str], int]:
    """A safetensors file's metadata and its size, checked against the header's tensors
    (SlotFileError when it is not a whole safetensors file)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("too short")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError("header past the end")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise SlotFileError("Unable to restore slot: no such file") from None
    except (OSError, ValueError, UnicodeDecodeError):
        raise SlotFileError("Unable to restore slot: invalid slot save file") from None
    if not isinstance(header, dict):
        raise SlotFileError("Unable to restore slot: invalid slot save file")
    end = 0
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise SlotFileError("Unable to restore slot: invalid slot save file")
        end = max(end, int(offsets[1]))
    if 8 + n + end != size:
        raise SlotFileError("Unable to restore slot: the file is truncated or damaged")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        return {}, size
    # save_prompt_cache flattens [metadata, classes, scalars]: ours are the "0." keys
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}, size


class SlotFiles:
    """Save, restore and erase slots of one engine, in one directory, through its prompt
    cache. `kv_type` and `model` name what the files must have been saved with."""

    def __init__(self, directory: Path, cache: PromptCache | None, kv_type: str, model: str):
        self.directory = directory
        self.cache = cache
        self.kv_type = kv_type
        self.model = model

    def _cache(self) -> PromptCache:
        if self.cache is None:
            raise SlotFileError(
                "saving and restoring slots needs the prompt cache (--cache-prompt, "
                "--cache-ram above 0)"
            )
        return self.cache

    def save(self, slot: int, filename: object) -> SlotFileResult:
        """Write what `slot` holds to `filename` (SlotFileError: a bad name, an empty slot)."""
        from mlx_lm.models.cache import save_prompt_cache

        from mlxcel.engine.text.kv_types import plain_cache

        start = time.perf_counter()
        path = slot_path(self.directory, filename)
        found = self._cache().slot_entry(slot)
        if found is None:
            raise SlotFileError(f"slot {slot} holds no cached tokens to save")
        tokens, held, cache = found
        meta = {
            "format": _FORMAT,
            "tokens": json.dumps(tokens),
            "held": str(held),  # the cache's tokens: more than `tokens` are cut at restore
            "kv_type": self.kv_type,
            "model": self.model,
        }
        temp = self.directory / f".{path.name}.{uuid.uuid4().hex}.safetensors"
        try:
            save_prompt_cache(str(temp), plain_cache(cache), meta)
            os.replace(temp, path)
        except OSError as exc:
            raise SlotFileError(f"Unable to save slot: {exc.strerror or exc}") from None
        finally:
            temp.unlink(missing_ok=True)
        return SlotFileResult(
            path.name, len(tokens), path.stat().st_size, (time.perf_counter() - start) * 1000
        )

    def restore(self, slot: int, filename: object) -> SlotFileResult:
        """Check `filename` and queue its cache for `slot`'s prompt cache (SlotFileError:
        a bad name, a missing, damaged or foreign file)."""
        start = time.perf_counter()
        path = slot_path(self.directory, filename)
        cache = self._cache()
        meta, size = _read_header(path)
        if meta.get("format") != _FORMAT:
            raise SlotFileError("Unable to restore slot: not an mlxcel slot save file")
        if meta.get("model") != self.model or meta.get("kv_type") != self.kv_type:
            raise SlotFileError(
                f"Unable to restore slot: saved with model {meta.get('model')!r} and KV type "
                f"{meta.get('kv_type')!r}; this server runs {self.model!r} with {self.kv_type!r}"
            )
        try:
            tokens = json.loads(meta.get("tokens", ""))
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("tokens")
        except ValueError:
            raise SlotFileError("Unable to restore slot: invalid slot save file") from None
        try:
            held = int(meta.get("held", len(tokens)))
        except ValueError:
            raise SlotFileError("Unable to restore slot: invalid slot save file") from None
        if held < len(tokens):
            raise SlotFileError("Unable to restore slot: invalid slot save file")
        cache.restore(slot, tokens, _loader(path, self.kv_type, held - len(tokens)))
        return SlotFileResult(path.name, len(tokens), size, (time.perf_counter() - start) * 1000)

    def erase(self, slot: int) -> int:
        """Forget what `slot` holds; the number of tokens erased."""
        return self.cache.erase_slot(slot) if self.cache is not None else 0


def _loader(path: Path, kv_type: str, extra: int) -> Callable[[], list[Any]]:
    """Engine thread: read `path` with mlx-lm's `load_prompt_cache` (through a hard link
    named `.safetensors`, the name MLX reads the format from) into the engine's KV classes,
    its last `extra` tokens (past the slot's) trimmed off."""

    def load() -> list[Any]:
        from mlx_lm.models.cache import load_prompt_cache

        from mlxcel.engine.text.kv_types import kv_type as named_type
        from mlxcel.engine.text.kv_types import typed_cache

        link = path.parent / f".{path.name}.{uuid.uuid4().hex}.safetensors"
        try:
            os.link(path, link)
            cache = load_prompt_cache(str(link))
        finally:
            link.unlink(missing_ok=True)
        if extra:
            for layer in cache:
                layer.trim(extra)
        return typed_cache(cache, named_type(kv_type) if kv_type else None)

    return load
