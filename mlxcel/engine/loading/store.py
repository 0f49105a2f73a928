"""The model store: where GGUF files converted to MLX live, keyed by the file's content hash.

Layout: `<root>/<stem>-<sha256[:12]>[-<variant>]/` holds one converted model (an MLX model
directory plus `mlxcel.json` naming its source). `<root>/hashes.json` memoizes file hashes by
(path, size, mtime) so a multi-GB file is hashed once. Entries are written to a hidden temporary
directory and renamed into place, so a half-written entry is never seen. Pure standard library.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.config import process_env

MANIFEST = "mlxcel.json"
_HASHES = "hashes.json"
_KEY_LENGTH = 12


@dataclass(frozen=True)
class StoreEntry:
    """One converted model in the store."""

    name: str  # the entry's directory name, also its key for `remove`
    path: Path
    size_bytes: int
    source: str  # the file it was converted from
    sha256: str = ""
    quantization: str = ""


class ModelStore:
    """Converted models under one root directory (created on first write)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser()

    @staticmethod
    def default_root() -> Path:
        """`$MLXCEL_MODEL_STORE`, else `~/.cache/mlxcel/models`."""
        return process_env.model_store() or Path.home() / ".cache" / "mlxcel" / "models"

    @classmethod
    def default(cls) -> ModelStore:
        """The store at `default_root()`."""
        return cls(cls.default_root())

    def file_hash(self, path: Path) -> str:
        """sha256 of a file's content, memoized by (path, size, mtime) in the store."""
        path = Path(path).resolve()
        stat = path.stat()
        memo_key = str(path)
        memo = self._read_hashes()
        seen = memo.get(memo_key)
        if (
            isinstance(seen, dict)
            and seen.get("size") == stat.st_size
            and seen.get("mtime_ns") == stat.st_mtime_ns
        ):
            return str(seen["sha256"])
        digest = sha256_file(path)
        memo[memo_key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        with contextlib.suppress(OSError):
            self._write_json(self.root / _HASHES, memo)
        return digest

    def find(self, sha256: str, variant: str = "") -> Path | None:
        """The entry converted from content `sha256` (and `variant`), if there is one."""
        if not self.root.is_dir():
            return None
        suffix = f"-{sha256[:_KEY_LENGTH]}" + (f"-{variant}" if variant else "")
        for path in sorted(self.root.glob(f"*{suffix}")):
            manifest = _read_manifest(path)
            if manifest.get("sha256") == sha256 and manifest.get("variant", "") == variant:
                return path
        return None

    def save(
        self,
        source: Path,
        sha256: str,
        write: Callable[[Path], None],
        *,
        variant: str = "",
        manifest: dict[str, Any] | None = None,
    ) -> Path:
        """Create the entry for `source`: `write(dir)` fills a fresh directory, then it is
        moved into place with `mlxcel.json` (source, hash, variant and `manifest`)."""
        name = entry_name(Path(source), sha256, variant)
        final = self.root / name
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.root))
        tmp.chmod(0o755)
        try:
            write(tmp)
            info = {
                **(manifest or {}),
                "source": str(Path(source).resolve()),
                "sha256": sha256,
                "variant": variant,
            }
            self._write_json(tmp / MANIFEST, info)
            if _read_manifest(final).get("sha256") == sha256:
                return final  # another process converted it meanwhile: keep theirs
            if final.exists():  # a broken entry
                shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def entries(self) -> list[StoreEntry]:
        """All complete entries, sorted by name."""
        if not self.root.is_dir():
            return []
        found = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not (path / MANIFEST).is_file():
                continue
            manifest = _read_manifest(path)
            found.append(
                StoreEntry(
                    name=path.name,
                    path=path,
                    size_bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                    source=str(manifest.get("source", "")),
                    sha256=str(manifest.get("sha256", "")),
                    quantization=str(manifest.get("quantization", "")),
                )
            )
        return found

    def remove(self, key: str) -> None:
        """Delete the entry named `key` (a name from `entries()`); KeyError if there is none."""
        for entry in self.entries():
            if key == entry.name:
                shutil.rmtree(entry.path)
                return
        raise KeyError(f"no model named {key!r} in the store at {self.root}")

    def _read_hashes(self) -> dict[str, Any]:
        try:
            data = json.loads((self.root / _HASHES).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_json(self, path: Path, data: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def entry_name(source: Path, sha256: str, variant: str = "") -> str:
    """The directory name of the entry for `source`: `<stem>-<sha256[:12]>[-<variant>]`."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", source.stem).strip("._") or "model"
    return f"{stem}-{sha256[:_KEY_LENGTH]}" + (f"-{variant}" if variant else "")


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in chunks."""
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # Python >= 3.11
            return hashlib.file_digest(f, "sha256").hexdigest()
        digest = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
        return digest.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
