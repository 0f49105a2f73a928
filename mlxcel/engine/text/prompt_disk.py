"""The prompt cache's disk tier: prefixes evicted from RAM, or held at shutdown, written to a
directory and found again after a restart or a model reload.

Entries live in `DIR/<namespace>/`, the namespace a digest of the model's identity (a hash
of its file's first bytes and size, or of a directory's config and weight names and sizes)
and the KV cache type, so a file is only ever read by the model and type that wrote it.
An entry is two files: `<digest>.safetensors` (mlx-lm's `save_prompt_cache` format) and
`<digest>.json` (its tokens, byte size and sha256), each written to a temporary name and
renamed, the index last. At start the directory is scanned: temporary files, data without
an index, an index that does not parse, names another namespace or disagrees with its
data's size are removed. Before an entry is read its data is checked against the sha256;
a mismatch (a damaged file) removes it. Nothing there ever reaches the model unchecked,
and no file error is raised to a request. The tier is bounded by bytes, least recently
used first.

Reads and writes run on the engine thread (the prompt cache's lookups and inserts), and
at shutdown after the engine stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.engine.text.kv_types import KVType

log = logging.getLogger(__name__)

_FORMAT = "mlxcel-prompt-cache-v1"
_IDENTITY_BYTES = 4 << 20  # the head of a model file hashed for its identity
# The names the tier writes: a namespace directory, and in it entry files and temporaries.
_NAMESPACE_NAME = re.compile(r"[0-9a-f]{16}")
_ENTRY_NAME = re.compile(r"\.?[0-9a-f]{32}\.(?:json|safetensors)")


def model_identity(path: Path) -> str:
    """A digest naming a model's weights: a file's size and first 4 MiB, or a directory's
    JSON files and the names and sizes of its weight files."""
    digest = hashlib.sha256()
    path = Path(path)
    if path.is_file():
        digest.update(str(path.stat().st_size).encode())
        with path.open("rb") as f:
            digest.update(f.read(_IDENTITY_BYTES))
    elif path.is_dir():
        for item in sorted(path.iterdir()):
            if item.suffix == ".json":
                digest.update(item.name.encode() + item.read_bytes())
            elif item.suffix in (".safetensors", ".gguf", ".npz"):
                digest.update(f"{item.name}:{item.stat().st_size}".encode())
    else:
        digest.update(str(path).encode())
    return digest.hexdigest()


def _tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:32]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class DiskEntry:
    digest: str
    tokens: list[int]
    nbytes: int
    sha256: str
    last_used: float


@dataclass(frozen=True)
class DiskStats:
    """The tier's size and counters (the server shapes them into `/v1/cache/stats`)."""

    directory: str
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    writes: int
    evictions: int
    removed_invalid: int


class DiskTier:
    """One model's and KV type's entries under `directory`, at most `capacity_bytes`.
    `identity`: the model's (`model_identity`); `kv_type`: the engine's KV cache type, the
    classes a read cache is given (None: the model's dtype)."""

    def __init__(
        self, directory: Path, capacity_bytes: int, identity: str, kv_type: KVType | None
    ) -> None:
        self.kv_type = kv_type
        identity = f"{identity}|{kv_type.name if kv_type is not None else 'model'}"
        self.root = Path(directory)
        self.namespace = hashlib.sha256(identity.encode()).hexdigest()[:16]
        self.dir = self.root / self.namespace
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        self.hits = self.writes = self.evictions = self.removed_invalid = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()

    # ------------------------------------------------------------------ bookkeeping

    def _scan(self) -> None:
        for path in list(self.dir.iterdir()):
            if path.name.startswith("."):  # a write that never finished
                self._remove_file(path)
        for index in sorted(self.dir.glob("*.json")):
            entry = self._read_index(index)
            if entry is None:
                self._remove(index.stem)
                self.removed_invalid += 1
                continue
            self._entries[entry.digest] = entry
        for data in self.dir.glob("*.safetensors"):
            if data.stem not in self._entries:
                self._remove_file(data)
                self.removed_invalid += 1
        self._fit(0)

    def _read_index(self, index: Path) -> DiskEntry | None:
        try:
            meta = json.loads(index.read_text(encoding="utf-8"))
            tokens = meta["tokens"]
            ok = (
                meta.get("format") == _FORMAT
                and meta.get("identity") == self.identity
                and isinstance(tokens, list)
                and all(isinstance(t, int) for t in tokens)
                and _tokens_digest(tokens) == index.stem
                and (self.dir / f"{index.stem}.safetensors").stat().st_size == meta["bytes"]
                and isinstance(meta.get("sha256"), str)
            )
            if not ok:
                return None
            return DiskEntry(index.stem, tokens, int(meta["bytes"]), meta["sha256"],
                             index.stat().st_mtime)  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _remove_file(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()

    def _remove(self, digest: str) -> None:
        self._entries.pop(digest, None)
        self._remove_file(self.dir / f"{digest}.json")
        self._remove_file(self.dir / f"{digest}.safetensors")

    def _fit(self, incoming: int) -> None:
        """Evict least recently used entries until `incoming` more bytes fit."""
        while self._entries and sum(e.nbytes for e in self._entries.values()) + incoming > (
            self.capacity_bytes
        ):
            oldest = min(self._entries.values(), key=lambda e: e.last_used)
            self._remove(oldest.digest)
            self.evictions += 1

    # ------------------------------------------------------------------ engine thread

    def write(self, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Store the KV cache of exactly `tokens` (evaluated arrays); whether it was written.
        A failure (a full disk, say) is logged, never raised."""
        from mlx_lm.models.cache import save_prompt_cache

        from mlxcel.engine.text.kv_types import plain_cache

        tokens = list(tokens)
        digest = _tokens_digest(tokens)
        with self._lock:
            if digest in self._entries:
                self._entries[digest].last_used = time.time()
                return False
        temp = self.dir / f".{uuid.uuid4().hex}.safetensors"
        data = self.dir / f"{digest}.safetensors"
        try:
            save_prompt_cache(str(temp), plain_cache(cache), {"format": _FORMAT})
            size = temp.stat().st_size
            if size > self.capacity_bytes:
                return False
            sha = _file_sha256(temp)
            with self._lock:
                self._fit(size)
            os.replace(temp, data)
            meta = {"format": _FORMAT, "identity": self.identity, "tokens": tokens,
                    "bytes": size, "sha256": sha}  # fmt: skip
            index_temp = self.dir / f".{uuid.uuid4().hex}.json"
            index_temp.write_text(json.dumps(meta), encoding="utf-8")
            os.replace(index_temp, self.dir / f"{digest}.json")
        except OSError:
            log.exception("writing a prompt-cache entry to %s failed", self.dir)
            self._remove_file(data)
            return False
        finally:
            self._remove_file(temp)
        with self._lock:
            self._entries[digest] = DiskEntry(digest, tokens, size, sha, time.time())
            self.writes += 1
        return True

    def best(self, tokens: Sequence[int], limit: int) -> tuple[DiskEntry | None, int]:
        """The entry sharing the longest prefix with `tokens` (at most `limit` tokens of it),
        and that length; (None, 0) when none shares any."""
        best: DiskEntry | None = None
        best_n = 0
        with self._lock:
            for entry in self._entries.values():
                n = 0
                for a, b in zip(entry.tokens, tokens, strict=False):
                    if a != b:
                        break
                    n += 1
                n = min(n, limit)
                if n > best_n:
                    best, best_n = entry, n
        return best, best_n

    def load(self, entry: DiskEntry) -> list[Any] | None:
        """`entry`'s cache, read after its sha256 is checked; None (and the entry removed)
        when its data is missing or damaged."""
        from mlx_lm.models.cache import load_prompt_cache

        from mlxcel.engine.text.kv_types import typed_cache

        data = self.dir / f"{entry.digest}.safetensors"
        try:
            if _file_sha256(data) != entry.sha256:
                raise ValueError("checksum mismatch")
            cache: list[Any] = typed_cache(load_prompt_cache(str(data)), self.kv_type)
        except Exception:  # a damaged or vanished file: never loaded, never raised
            log.warning("prompt-cache file %s is damaged or missing; removed", data.name)
            with self._lock:
                self._remove(entry.digest)
                self.removed_invalid += 1
            return None
        with self._lock:
            entry.last_used = time.time()
            self.hits += 1
        with contextlib.suppress(OSError):
            os.utime(self.dir / f"{entry.digest}.json")
        return cache

    # ------------------------------------------------------------------ any thread

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(
                str(self.root),
                len(self._entries),
                sum(e.nbytes for e in self._entries.values()),
                self.capacity_bytes,
                self.hits,
                self.writes,
                self.evictions,
                self.removed_invalid,
            )


@dataclass(frozen=True)
class StoredNamespace:
    """One model's and KV type's entries in a disk-tier directory (`mlxcel cache prompts`)."""

    namespace: str
    entries: int
    bytes: int


def list_directory(directory: Path) -> list[StoredNamespace]:
    """What a disk-tier directory holds, per namespace (no file is read but its size)."""
    out: list[StoredNamespace] = []
    root = Path(directory)
    if not root.is_dir():
        return out
    for space in sorted(_namespaces(root)):
        files = [f for f in space.iterdir() if _is_entry_file(f)]
        out.append(
            StoredNamespace(
                space.name,
                sum(1 for f in files if f.suffix == ".json" and not f.name.startswith(".")),
                sum(f.stat().st_size for f in files),
            )
        )
    return out


def clear_directory(directory: Path) -> tuple[int, int]:
    """Remove every entry file of a disk-tier directory: (files removed, bytes freed).
    Only the names the tier writes are touched (namespace directories of 16 hex digits
    holding `<32 hex>.safetensors|json` and their temporaries): a directory given by
    mistake, a models folder say, keeps its own files."""
    removed = freed = 0
    root = Path(directory)
    if not root.is_dir():
        return 0, 0
    for space in _namespaces(root):
        for f in space.iterdir():
            if _is_entry_file(f):
                freed += f.stat().st_size
                f.unlink()
                removed += 1
        with contextlib.suppress(OSError):
            space.rmdir()
    return removed, freed


def _namespaces(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if _NAMESPACE_NAME.fullmatch(p.name) and p.is_dir()]


def _is_entry_file(path: Path) -> bool:
    return bool(_ENTRY_NAME.fullmatch(path.name)) and path.is_file() and not path.is_symlink()
