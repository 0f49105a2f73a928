"""The models a router serves and the settings each one runs with.

Named as llama-server names them: in `--models-dir`, a `.gguf` file is a model named after
the file without `.gguf`, a directory is a model named after the directory (an MLX or
Hugging Face model directory, or a directory holding one GGUF file, its first shard when
split), and a Hugging Face cache entry (`models--org--name`) is the repo id `org/name`.
A `--models-preset` section adds a model (with `model = PATH`) or sets options for one
of the directory's. Each model runs with the server's settings, then the preset's `[*]`,
then its own section, and the options given on the command line over both.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel.config import Settings, SettingsError
from mlxcel.server.router.preset import DEFAULT_STOP_TIMEOUT, PresetSection, read_preset

_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".npz", ".bin")


class ModelKind(str, enum.Enum):
    """What a model serves, known before it loads."""

    TEXT = "text"  # chat and completions (mlx-lm, GGUF)
    VISION = "vision"  # chat with images, video or audio inputs (mlx-vlm)
    EMBEDDING = "embedding"  # an encoder: embeddings, and rerank by cosine
    RERANK = "rerank"  # a cross-encoder: rerank only
    TRANSCRIPTION = "transcription"  # Whisper: transcriptions and translations
    SPEECH = "speech"  # Kokoro: text to speech
    IMAGE = "image"  # an mflux pipeline: image generations and edits

    @property
    def uses(self) -> frozenset[str]:
        """The request kinds (see `mlxcel.server.router.dispatch.request_use`) it answers."""
        return _USES[self]


_USES = {
    ModelKind.TEXT: frozenset({"chat"}),
    ModelKind.VISION: frozenset({"chat"}),
    ModelKind.EMBEDDING: frozenset({"embeddings", "rerank"}),
    ModelKind.RERANK: frozenset({"rerank"}),
    ModelKind.TRANSCRIPTION: frozenset({"transcription"}),
    ModelKind.SPEECH: frozenset({"speech"}),
    ModelKind.IMAGE: frozenset({"images"}),
}
_SIDE_MODEL_FIELD = {
    ModelKind.TRANSCRIPTION: "audio_model",
    ModelKind.SPEECH: "tts_model",
    ModelKind.IMAGE: "image_model",
}
"""The setting that loads a model of this kind on a server without a chat model."""


@dataclass(frozen=True)
class ModelEntry:
    """One model of the router: its name, where it is, what it is and how it runs."""

    name: str
    ref: str  # what `-m` gets: a file, a directory or a cached repo id
    kind: ModelKind
    settings: Settings
    source: str  # "models_dir" or "preset"
    aliases: tuple[str, ...] = ()
    args: tuple[str, ...] = ()  # the preset's options as flags (shown in /models)
    load_on_startup: bool = False
    stop_timeout: float = DEFAULT_STOP_TIMEOUT
    pinned: bool = False
    weight_bytes: int = 0  # the weight files' size: what loading it adds to memory

    def names(self) -> tuple[str, ...]:
        """Every name a request may use for it."""
        return (self.name, *self.aliases)


@dataclass
class Catalog:
    """Every model of the router, in name order, and what reading them warned about."""

    entries: list[ModelEntry]
    warnings: list[str] = field(default_factory=list)


def router_wanted(settings: Settings) -> bool:
    """Router mode: `--models-dir` or `--models-preset` given (SettingsError with `-m`)."""
    if not (settings.models_dir or settings.models_preset):
        return False
    if settings.model:
        raise SettingsError(
            "--models-dir/--models-preset serve several models (router mode): drop -m, or drop "
            "them to serve the one model"
        )
    return True


def build_catalog(settings: Settings, cli_fields: Collection[str] = ()) -> Catalog:
    """The router's models from `--models-dir` and `--models-preset` (SettingsError when the
    directory or preset cannot be read, or a preset model has no `model`)."""
    found: dict[str, str] = {}
    warnings: list[str] = []
    if settings.models_dir:
        found = scan_models_dir(Path(settings.models_dir).expanduser(), warnings)
    preset = read_preset(settings.models_preset) if settings.models_preset else None
    warnings += preset.warnings if preset else []
    sections = {s.name: s for s in preset.sections} if preset else {}
    sources = dict.fromkeys(found, "models_dir")
    for name, section in sections.items():
        ref = section.options.get("model")
        if ref:
            found[name], sources[name] = str(ref), "preset"
        elif name not in found:
            raise SettingsError(
                f"--models-preset [{name}]: no such model in --models-dir; give model = PATH"
            )
    defaults = preset.defaults if preset else PresetSection("*")
    entries = []
    for name in sorted(found):
        section = sections.get(name, PresetSection(name))
        entries.append(
            _entry(name, found[name], sources[name], settings, defaults, section, cli_fields)
        )
    _check_names(entries)
    return Catalog(entries, warnings)


def scan_models_dir(root: Path, warnings: list[str] | None = None) -> dict[str, str]:
    """Model name -> reference, for every model in `root` (see the module doc); an entry
    whose name is not UTF-8 (it could be no JSON model id) is skipped with a warning."""
    if not root.is_dir():
        raise SettingsError(f"--models-dir: {root}: no such directory")
    found: dict[str, str] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith("."):
            continue
        if not _utf8(path.name):
            if warnings is not None:
                shown = path.name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                warnings.append(f"--models-dir: skipping {shown!r}: its name is not UTF-8")
            continue
        if path.is_file() and path.suffix == ".gguf":
            found[path.name[: -len(".gguf")]] = str(path)
        elif path.is_dir() and path.name.startswith("models--"):
            snapshot = _cached_snapshot(path)
            if snapshot is not None:
                found["/".join(path.name.split("--")[1:])] = str(snapshot)
        elif path.is_dir():
            ref = _model_in_dir(path)
            if ref is not None:
                found[path.name] = ref
    return found


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes, kept by the file system as surrogates
        return False
    return True


def _model_in_dir(path: Path) -> str | None:
    """The reference of the model directory `path`: itself when it holds a config.json (or
    a diffusers model_index.json), else its GGUF file (the first shard of a split one,
    never an `mmproj` file)."""
    if (path / "config.json").is_file() or (path / "model_index.json").is_file():
        return str(path)
    ggufs = sorted(p for p in path.glob("*.gguf") if "mmproj" not in p.name)
    shards = [p for p in ggufs if "-00001-of-" in p.name]
    chosen = shards or ggufs
    return str(chosen[0]) if chosen else None


def _cached_snapshot(repo_dir: Path) -> Path | None:
    """A Hugging Face cache entry's snapshot (the one `refs/main` names, else the newest)."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text(encoding="utf-8").strip()
        if named.is_dir():
            return named
    dirs = [p for p in snapshots.glob("*") if p.is_dir()] if snapshots.is_dir() else []
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def _entry(
    name: str,
    ref: str,
    source: str,
    base: Settings,
    defaults: PresetSection,
    section: PresetSection,
    cli_fields: Collection[str],
) -> ModelEntry:
    options = {**defaults.options, **section.options}
    aliases = tuple(a for a in _split(options.pop("alias", None)) if a != name)
    options.pop("model", None)
    kind = model_kind(ref)
    values: dict[str, Any] = base.model_dump()
    values.update({k: v for k, v in options.items() if k not in cli_fields})
    values.update(model=ref, alias=name, models_dir=None, models_preset=None)
    if kind in (ModelKind.EMBEDDING, ModelKind.RERANK):
        values.update(embedding=kind is ModelKind.EMBEDDING, reranking=True)
    if kind in _SIDE_MODEL_FIELD:
        values.update({"model": None, _SIDE_MODEL_FIELD[kind]: ref})
    try:
        settings = Settings.model_validate(values)
    except ValueError as exc:
        raise SettingsError(f"model {name}: {exc}") from None
    return ModelEntry(
        name=name,
        ref=ref,
        kind=kind,
        settings=settings,
        source=source,
        aliases=aliases,
        args=tuple(defaults.args + section.args),
        load_on_startup=_first(section.load_on_startup, defaults.load_on_startup, False),
        stop_timeout=_first(section.stop_timeout, defaults.stop_timeout, DEFAULT_STOP_TIMEOUT),
        pinned=_first(section.pinned, defaults.pinned, False),
        weight_bytes=weight_bytes(ref),
    )


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _split(value: object) -> list[str]:
    return [a.strip() for a in str(value or "").split(",") if a.strip()]


def model_kind(ref: str) -> ModelKind:
    """What the model at `ref` serves, read from its config or GGUF header (no weights)."""
    from mlxcel.engine.embeddings.loader import is_encoder_model
    from mlxcel.engine.vision.loader import vision_model_path

    side = _side_model_kind(ref)
    if side is not None:
        return side
    if is_encoder_model(ref):
        config = Path(ref) / "config.json"
        if config.is_file():
            try:
                archs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
            except (OSError, ValueError, AttributeError):
                archs = []
            if any(str(a).endswith("ForSequenceClassification") for a in archs):
                return ModelKind.RERANK
        return ModelKind.EMBEDDING
    if vision_model_path(ref) is not None:
        return ModelKind.VISION
    return ModelKind.TEXT


def _side_model_kind(ref: str) -> ModelKind | None:
    """An image, text-to-speech or Whisper model directory's kind (None: none of those)."""
    from mlxcel.engine.audio.tts import is_kokoro_dir
    from mlxcel.engine.audio.whisper import locate_whisper
    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.engine.image.families import detect_family

    path = Path(ref).expanduser()
    if not path.is_dir():
        return None
    if (path / "model_index.json").is_file():
        try:
            detect_family(path)
            return ModelKind.IMAGE
        except (ModelLoadError, OSError, ValueError):
            return None
    if is_kokoro_dir(path):
        return ModelKind.SPEECH
    try:
        locate_whisper(str(path))
    except ModelLoadError:
        return None
    return ModelKind.TRANSCRIPTION


def weight_bytes(ref: str) -> int:
    """The size of the weight files of the model at `ref` (0 when it is not a local path)."""
    path = Path(ref).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES)
    return 0


def _check_names(entries: Iterable[ModelEntry]) -> None:
    """Refuse a name or alias that two models share (SettingsError)."""
    owner: dict[str, str] = {}
    for entry in entries:
        for name in entry.names():
            if name in owner and owner[name] != entry.name:
                raise SettingsError(
                    f"models {owner[name]} and {entry.name} both answer to the name {name!r}"
                )
            owner[name] = entry.name
