"""Sampling: per-request parameters, logits processors and token samplers.

`SamplingParams` is pure data and imports no MLX; `make_sampling` (and the rest of the
`chain`, `processors` and `samplers` modules) is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlxcel.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from mlxcel.engine.sampling.chain import make_sampling

__all__ = ["SamplingParams", "make_sampling"]


def __getattr__(name: str) -> Any:
    if name == "make_sampling":
        from mlxcel.engine.sampling.chain import make_sampling

        return make_sampling
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
