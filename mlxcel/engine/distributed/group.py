"""The group of ranks this process belongs to, as `mlx.launch` started it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxcel.engine.errors import EngineError, ModelLoadError

if TYPE_CHECKING:
    import mlx.core as mx

LAUNCH_VARIABLES = (
    "MLX_HOSTFILE",  # ring backend (mlx.launch --backend ring)
    "MLX_RANK",
    "MLX_IBV_DEVICES",  # JACCL backend (Thunderbolt 5 RDMA)
    "MLX_JACCL_COORDINATOR",
    "OMPI_COMM_WORLD_SIZE",  # MPI backend (mpirun)
)
"""Variables `mlx.launch` (or mpirun) sets for each rank: without any, no group is joined."""


class DistributedError(ModelLoadError):
    """The group cannot be joined, or the model cannot be split across it (exit 2)."""


class GroupBrokenError(EngineError):
    """A rank of the group is gone or stopped answering: the engine refuses work (maps to
    HTTP 503 `unavailable_error`)."""


@dataclass(frozen=True)
class Ranks:
    """A group of ranks and this process's place in it."""

    group: mx.distributed.Group
    rank: int
    size: int

    @property
    def leader(self) -> bool:
        """Rank 0: it serves, schedules and samples; the others follow its steps."""
        return self.rank == 0


def launched() -> bool:
    """Whether a launcher set this process up as one rank of a group."""
    return any(os.environ.get(name) for name in LAUNCH_VARIABLES)


def join_group(required: bool = False) -> Ranks | None:
    """The group this process was launched into; None when it runs alone.

    Without `required` (`--distributed`), a group is joined only when a launcher's
    variables are set and MLX reports more than one rank. With it, MLX must give a group
    of two ranks or more (DistributedError otherwise).
    """
    if not required and not launched():
        return None
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=required)
    except (RuntimeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"--distributed: cannot join a group of ranks ({reason}); start mlxcel under mlx.launch"
        ) from None
    if group.size() < 2:
        if required:
            raise DistributedError(
                "--distributed: MLX reports a single rank; start mlxcel under mlx.launch "
                "with two hosts or more (e.g. mlx.launch --hostfile hosts.json -- mlxcel serve ...)"
            )
        return None
    return Ranks(group=group, rank=group.rank(), size=group.size())
