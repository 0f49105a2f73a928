"""Pooling: token vectors → one vector per input (mean, cls, last) or none (every token)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from mlxcel.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np
    import numpy.typing as npt

log = logging.getLogger(__name__)

Pooling = Literal["none", "mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("none", "mean", "cls", "last")

# sentence-transformers' 1_Pooling flags, in the order they are checked.
_ST_FLAGS: tuple[tuple[str, str], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean"),
    ("pooling_mode_weightedmean_tokens", "mean"),
)


def check_pooling(value: str) -> Pooling:
    """`value` as a Pooling, or InvalidRequestError naming the choices."""
    if value not in POOLINGS:
        raise InvalidRequestError(f"pooling {value!r} is not one of {', '.join(POOLINGS)}")
    return cast(Pooling, value)


def pooling_from_dir(path: Path) -> Pooling | None:
    """The pooling a sentence-transformers `1_Pooling/config.json` (or `pooling_mode`) names."""
    for candidate in sorted(path.glob("*_Pooling/config.json")):
        try:
            data = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        mode = data.get("pooling_mode")
        if isinstance(mode, str):
            mapped = {"lasttoken": "last", "cls": "cls", "mean": "mean"}.get(mode)
            if mapped:
                return cast(Pooling, mapped)
        for flag, pooling in _ST_FLAGS:
            if data.get(flag):
                return cast(Pooling, pooling)
        if data.get("pooling_mode_max_tokens"):
            log.warning("%s: max pooling is not supported; using mean pooling", path.name)
            return "mean"
    return None


def pool(hidden: mx.array, mask: mx.array, method: Pooling) -> mx.array:
    """Pool hidden states (B, T, H) of right-padded inputs into (B, H); `mask` is 1 on tokens.

    `none` is not handled here: the caller keeps every token vector.
    """
    import mlx.core as mx

    if method == "cls":
        return hidden[:, 0]
    if method == "last":
        last = mask.astype(mx.int32).sum(axis=1) - 1
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if method == "mean":
        weights = mask[..., None].astype(hidden.dtype)
        return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1.0)
    raise InvalidRequestError(f"pooling {method!r} cannot make one vector per input")


def pooled_vectors(
    hidden: mx.array, mask: mx.array, lengths: list[int], method: Pooling
) -> list[npt.NDArray[np.float32]]:
    """NumPy float32 vectors of one batch: (H,) per row, or (tokens, H) with `none`."""
    import mlx.core as mx
    import numpy as np

    if method == "none":
        mx.eval(hidden)
        return [np.array(hidden[i, :n].astype(mx.float32)) for i, n in enumerate(lengths)]
    pooled = pool(hidden, mask, method).astype(mx.float32)
    mx.eval(pooled)
    matrix = np.array(pooled)
    return [matrix[i] for i in range(matrix.shape[0])]
