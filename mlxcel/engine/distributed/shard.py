"""Split a loaded model across the ranks of a group, with mlx-lm's own sharding.

Tensor parallel: the family's `Model.shard(group)` (each rank keeps a slice of every
layer's weights; the layers' outputs are summed across ranks). Pipeline parallel: the
family's `pipeline(group)` (its `PipelineMixin`: each rank keeps a run of whole layers, the
hidden state is passed rank to rank). Tensor parallel is the default where the family has
it; `--pipeline` asks for layers.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from mlxcel.engine.distributed.group import DistributedError, Ranks

if TYPE_CHECKING:
    from mlxcel.engine.loading.model import LoadedModel

ShardMode = Literal["tensor", "pipeline"]


def _module(model_type: str) -> Any | None:
    try:
        return importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        return None


def family_modes(model_type: str) -> tuple[ShardMode, ...]:
    """The ways mlx-lm can split the family `model_type` (its `mlx_lm.models` module)."""
    from mlx_lm.models.pipeline import PipelineMixin

    module = _module(model_type)
    if module is None:
        return ()
    modes: list[ShardMode] = []
    if hasattr(getattr(module, "Model", None), "shard"):
        modes.append("tensor")
    classes = [v for v in vars(module).values() if isinstance(v, type)]
    if any(issubclass(c, PipelineMixin) and c is not PipelineMixin for c in classes):
        modes.append("pipeline")
    return tuple(modes)


@cache
def families(mode: ShardMode) -> tuple[str, ...]:
    """The mlx-lm families that can be split by `mode` (read from their sources)."""
    import mlx_lm.models

    marker = "def shard(" if mode == "tensor" else "PipelineMixin"
    found = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name == "pipeline":
            continue
        spec = importlib.util.find_spec(f"mlx_lm.models.{info.name}")
        origin = spec.origin if spec is not None else None
        try:
            with open(origin or "", encoding="utf-8") as f:
                if marker in f.read():
                    found.append(info.name)
        except OSError:
            continue
    return tuple(sorted(found))


def choose_mode(model_type: str, *, pipeline: bool) -> ShardMode:
    """How `model_type` is split: tensor parallel where it can be and `pipeline` is off,
    else pipeline parallel; DistributedError naming the families that can otherwise."""
    modes = family_modes(model_type)
    if pipeline and "pipeline" in modes:
        return "pipeline"
    if not pipeline and modes:
        return modes[0]
    if pipeline:
        hint = "; it can run tensor parallel (without --pipeline)" if modes else ""
        raise DistributedError(
            f"--pipeline: the {model_type} family cannot be split by layers{hint}; "
            f"families that can: {', '.join(families('pipeline'))}"
        )
    raise DistributedError(
        f"the {model_type} family can be split across ranks neither by tensors nor by "
        f"layers; tensor parallel: {', '.join(families('tensor'))}; pipeline parallel "
        f"(--pipeline or as a fallback): {', '.join(families('pipeline'))}"
    )


def shard_model(model: Any, model_type: str, ranks: Ranks, *, pipeline: bool) -> ShardMode:
    """Keep only this rank's part of `model` (loaded lazily or not); its parameters are
    evaluated here, and the ranks meet once so none starts serving before the others
    have loaded."""
    import mlx.core as mx

    mode = choose_mode(model_type, pipeline=pipeline)
    try:
        if mode == "tensor":
            model.shard(ranks.group)
        else:
            model.model.pipeline(ranks.group)
        mx.eval(model.parameters())
    except (ValueError, AttributeError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"cannot split {model_type} {mode}-parallel across {ranks.size} ranks: {reason}"
        ) from None
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=ranks.group, stream=mx.cpu))
    return mode


def model_type_of(model: Any) -> str:
    """The mlx-lm family of a built model (`mlx_lm.models.<family>.Model`)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def shard_loaded(loaded: LoadedModel, ranks: Ranks, *, pipeline: bool) -> None:
    """`shard_model` on a loaded text model; its info then says the rank, the group's
    size and how it is split (`info.extra["distributed"]`)."""
    model_type = model_type_of(loaded.model)
    mode = shard_model(loaded.model, model_type, ranks, pipeline=pipeline)
    extra = {**loaded.info.extra, "distributed": distributed_info(ranks, mode)}
    loaded.info = replace(loaded.info, extra=extra)


def distributed_info(ranks: Ranks, mode: ShardMode) -> dict[str, int | str]:
    """What `/props` and `mlxcel bench` report of the group."""
    return {"world_size": ranks.size, "rank": ranks.rank, "mode": mode}


def model_type_at(ref: str | None) -> str:
    """The mlx-lm family of the model `ref` names, read without its weights (a GGUF file's
    header, a directory's config.json; None: the built-in model); "" when unknown."""
    from pathlib import Path

    from mlxcel.engine.loading.default_model import default_model_path
    from mlxcel.engine.loading.describe import UNKNOWN, describe_model

    path = default_model_path() if not ref else Path(ref).expanduser()
    if ref and not path.exists():
        from mlxcel.engine.loading.hf_cache import resolve_hf_repo

        try:
            path = resolve_hf_repo(ref, allow_download=False)
        except ValueError:
            return ""
    architecture = describe_model(path).architecture
    if architecture == UNKNOWN:
        return ""
    if path.is_file():
        from mlxcel.engine.loading.gguf import read_gguf_header
        from mlxcel.engine.loading.gguf_arch import find_architecture

        try:
            return find_architecture(architecture, read_gguf_header(path).metadata).model_type
        except (OSError, ValueError):
            return ""
    return architecture
