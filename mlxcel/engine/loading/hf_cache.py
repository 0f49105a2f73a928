"""Hugging Face repo ids → local snapshot directories, offline first.

A repo already in the local Hugging Face cache resolves without touching the network. When
it is missing and downloads are allowed (`HF_HUB_OFFLINE` is not set), only the files an MLX
text model needs are fetched, with a rich progress bar on stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.engine.errors import ModelLoadError

#: The files an MLX text model needs from a repo.
MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja")

_NAME_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_REPO_ID = re.compile(rf"{_NAME_PART}/{_NAME_PART}")
_TRUE = {"1", "on", "yes", "true"}


class ModelNotFoundError(ModelLoadError):
    """A repo is not in the local cache and cannot be downloaded."""


@dataclass(frozen=True)
class CachedRepo:
    """A model repo in the Hugging Face cache."""

    repo_id: str
    path: Path  # the snapshot of `main` (else the newest one)
    size_bytes: int


def looks_like_repo_id(ref: str) -> bool:
    """Whether `ref` has the shape of a Hugging Face repo id ("org/name")."""
    if not _REPO_ID.fullmatch(ref) or ".." in ref or "--" in ref:
        return False
    return not ref.lower().endswith((".gguf", ".git"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        value = os.environ.get(var)
        if value:
            return Path(value).expanduser()
    hf_home = os.environ.get("HF_HOME")
    if hf_home:
        return Path(hf_home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hf_offline() -> bool:
    """Whether downloads are off (`HF_HUB_OFFLINE`, read at call time)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUE
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        return True


def resolve_hf_repo(
    repo_id: str, *, revision: str | None = None, allow_download: bool | None = None
) -> Path:
    """The local snapshot directory of `repo_id`, downloading it only when allowed.

    `allow_download=None` means "unless HF_HUB_OFFLINE is set". Raises ModelNotFoundError
    (one line, saying how to fix it) when the model is not available.
    """
    if not looks_like_repo_id(repo_id):
        raise ModelNotFoundError(f"{repo_id!r} is not a Hugging Face repo id (expected 'org/name')")
    cache_dir = hf_cache_dir()
    cached, hub_missing = _cached_snapshot(repo_id, revision, cache_dir)
    missing = _missing_files(cached) + hub_missing if cached is not None else []
    if cached is not None and not missing:
        return cached

    if allow_download is None:
        allow_download = not hf_offline()
    if not allow_download:
        why = "HF_HUB_OFFLINE is set" if hf_offline() else "downloads are off"
        at = f"@{revision}" if revision else ""
        if cached is not None:
            raise ModelNotFoundError(
                f"{repo_id}{at} is only partly in the Hugging Face cache ({cache_dir}; missing "
                f"{', '.join(missing)}) and {why}: download it with `hf download {repo_id}` "
                "where the network is allowed"
            )
        raise ModelNotFoundError(
            f"{repo_id}{at} is not in the Hugging Face cache ({cache_dir}) and {why}: "
            f"download it with `hf download {repo_id}` where the network is allowed, "
            "or pass a local model path"
        )

    path = _download(repo_id, revision, cache_dir)
    missing = _missing_files(path)
    if missing:
        raise ModelNotFoundError(
            f"{repo_id} has no {', '.join(missing)}; it is not an MLX/safetensors text model "
            "(for a GGUF repo, download the .gguf file and pass its path)"
        )
    return path


def list_hf_cache(cache_dir: Path | None = None) -> list[CachedRepo]:
    """The model repos in the Hugging Face cache, sorted by repo id."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir or hf_cache_dir())
    except (CacheNotFound, ValueError, OSError):
        return []
    repos: list[CachedRepo] = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        revision = repo.refs.get("main") or max(
            repo.revisions, key=lambda r: r.last_modified, default=None
        )
        path = revision.snapshot_path if revision is not None else repo.repo_path
        repos.append(CachedRepo(repo.repo_id, Path(path), int(repo.size_on_disk)))
    return sorted(repos, key=lambda r: r.repo_id.lower())


def delete_hf_repo(repo_id: str, cache_dir: Path | None = None) -> int:
    """Remove every cached revision of model repo `repo_id`; returns the bytes freed."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    root = cache_dir or hf_cache_dir()
    try:
        info = scan_cache_dir(root)
    except (CacheNotFound, ValueError, OSError) as exc:
        raise ModelNotFoundError(f"{repo_id} is not in the Hugging Face cache ({root})") from exc
    matches = [r for r in info.repos if r.repo_type == "model" and r.repo_id == repo_id]
    if not matches:
        raise ModelNotFoundError(f"{repo_id} is not in the Hugging Face cache ({root})")
    repo = matches[0]
    hashes = {r.commit_hash for r in repo.revisions}
    # huggingface_hub deletes by commit hash across the whole cache, so it is used only when
    # no other repo (a duplicate or a mirror) holds one of the same commits.
    shared = any(
        r.commit_hash in hashes
        for other in info.repos
        if other is not repo
        for r in other.revisions
    )
    if not hashes or shared:
        shutil.rmtree(repo.repo_path)
        return int(repo.size_on_disk)
    strategy = info.delete_revisions(*hashes)
    strategy.execute()
    return int(strategy.expected_freed_size)


def _cached_snapshot(
    repo_id: str, revision: str | None, cache_dir: Path
) -> tuple[Path | None, list[str]]:
    """The cached snapshot (or None), and what the hub's file listing says it lacks."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(cache_dir),
            local_files_only=True,
            allow_patterns=list(MODEL_FILE_PATTERNS),
        )
    except LocalEntryNotFoundError as exc:
        partial = getattr(exc, "snapshot_path", None)  # an incomplete snapshot (newer hubs)
        if partial and Path(partial).is_dir():
            return Path(partial), ["files of an interrupted download"]
        return None, []
    except ValueError:  # a repo id the hub library rejects
        return None, []
    return Path(str(found)), []


def _missing_files(path: Path) -> list[str]:
    """What a text model needs and `path` lacks: config.json and the safetensors weights."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        except (OSError, ValueError):
            shards = []
        missing += [s for s in shards if not (path / s).is_file()]
    elif not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def _download(repo_id: str, revision: str | None, cache_dir: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        with _RichProgress(f"downloading {repo_id}") as progress:
            found = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache_dir),
                allow_patterns=list(MODEL_FILE_PATTERNS),
                tqdm_class=progress.tqdm_class,
            )
    except GatedRepoError as exc:
        raise ModelNotFoundError(
            f"{repo_id} is gated: accept its terms on huggingface.co and log in (`hf auth login`)"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"no Hugging Face repo {repo_id} (or it is private: log in with `hf auth login`)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - network and hub errors of every kind
        raise ModelNotFoundError(f"could not download {repo_id}: {_first_line(exc)}") from exc
    return Path(str(found))


class _RichProgress:
    """A rich progress display that huggingface_hub drives through a tqdm-compatible class."""

    def __init__(self, title: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.title = title
        self.tqdm_class = _rich_tqdm_class(self.progress)

    def __enter__(self) -> _RichProgress:
        self.progress.start()
        self.progress.console.print(self.title)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.stop()


def _rich_tqdm_class(progress: Any) -> type:
    """A tqdm subclass whose bars are tasks of `progress` (one shared live display)."""
    from tqdm.std import tqdm as std_tqdm

    class RichTqdm(std_tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["gui"] = True  # keep tqdm's own text printer off
            kwargs.setdefault("disable", False)
            super().__init__(*args, **kwargs)
            self._task = None
            if not self.disable:
                self._task = progress.add_task(self.desc or "", total=None, counts="")
                self.display()

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            task = getattr(self, "_task", None)
            if task is None:
                return True
            total = self.total or None
            visible = bool(total) or self.n > 0 or self.unit != "B"
            progress.update(
                task,
                description=self.desc or "",
                completed=self.n,
                total=total,
                counts=_counts(self.n, total, self.unit),
                visible=visible,
            )
            return True

        def clear(self, nolock: bool = False) -> None:
            pass

        def close(self) -> None:
            if self.disable:
                return
            self.display()
            super().close()

        def reset(self, total: float | None = None) -> None:
            super().reset(total=total)
            self.display()

    return RichTqdm


def _counts(n: float, total: float | None, unit: str) -> str:
    if unit == "B":
        done = _human_bytes(n)
        return f"{done}/{_human_bytes(total)}" if total else done
    return f"{int(n)}/{int(total)} {unit}" if total else f"{int(n)} {unit}"


def _human_bytes(size: float) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
