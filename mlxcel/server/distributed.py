"""`mlxcel serve` as one rank of a group started by `mlx.launch`.

Rank 0 is the server: it listens, schedules and answers; its engine sends every step to
the other ranks (`mlxcel.engine.distributed`). Every other rank loads its shard and follows
(`run_follower`) until rank 0 stops, or exits non-zero when rank 0 is gone. What a split
model cannot do is refused before the port opens (exit 2): router mode, vision models,
speculative decoding, sleeping on idle, slot files, and a family mlx-lm can split neither
by tensors nor by layers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.distributed.group import Ranks


def join_ranks(settings: Settings) -> Ranks | None:
    """The group this server is one rank of (None: it runs alone); DistributedError when
    `--distributed` is on and no group can be joined."""
    from mlxcel.engine.distributed.group import join_group

    return join_group(required=settings.distributed)


def check_distributed(settings: Settings) -> None:
    """Refuse (SettingsError, DistributedError) what a model split across ranks cannot do."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.distributed.shard import choose_mode, model_type_at
    from mlxcel.engine.vision.loader import vision_model_path
    from mlxcel.server.router.catalog import router_wanted

    if router_wanted(settings):
        raise SettingsError("router mode (--models-dir, --models-preset) cannot be distributed")
    if settings.spec_draft_model or str(settings.spec_type or "none") not in ("none", ""):
        raise SettingsError("speculative decoding (--spec-type, -md) cannot be distributed")
    if settings.sleep_idle_seconds >= 0:
        raise SettingsError("--sleep-idle-seconds cannot be used with a distributed model")
    if vision_model_path(settings.model) is not None:
        raise SettingsError("a vision model cannot be distributed (text models only)")
    if settings.slot_save_path:
        raise SettingsError(
            "--slot-save-path cannot be used with a distributed model (each rank holds only "
            "its shard of a slot's KV cache)"
        )
    choose_mode(model_type_at(settings.model) or "unknown", pipeline=settings.pipeline)


def rank_settings(settings: Settings, ranks: Ranks | None) -> Settings:
    """`settings` for this rank: its prompt-cache disk tier in a directory of its own (each
    rank caches its own shard of the KV, whose shapes depend on the group's size and how the
    model is split; ranks may share a disk)."""
    if ranks is None or not settings.prompt_cache_dir:
        return settings
    split = "pipeline" if settings.pipeline else "tensor"
    group = f"{ranks.size}-ranks-{split}/rank-{ranks.rank}"
    directory = Path(settings.prompt_cache_dir).expanduser() / group
    return settings.model_copy(update={"prompt_cache_dir": str(directory)})


def run_follower(settings: Settings, ranks: Ranks) -> int:
    """A rank other than 0: load its shard, follow rank 0's steps until it stops; the exit
    status (1 when the group broke, 2 when the model cannot be loaded)."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.server.boot import build_text_engine
    from mlxcel.server.state import ServerState

    state = ServerState(settings=settings, ranks=ranks)
    try:
        engine, loaded = build_text_engine(state)
    except (ModelLoadError, SettingsError) as exc:
        print(f"mlxcel: error: rank {ranks.rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    mode = loaded.info.extra.get("distributed", {}).get("mode", "")
    print(
        f"mlxcel: rank {ranks.rank} of {ranks.size} ({mode} parallel) following rank 0",
        file=sys.stderr,
        flush=True,
    )
    failure = engine.follow()
    engine.stop()
    if failure is None and state.prompt_cache is not None:
        state.prompt_cache.persist()  # to the disk tier, if any, as rank 0 does at its stop
    if failure is not None:
        print(f"mlxcel: error: rank {ranks.rank}: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0
