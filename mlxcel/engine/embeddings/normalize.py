"""Embedding normalization with llama-server's `--embd-normalize` meaning.

-1: none; 0: max-abs scaled to the int16 range (largest magnitude becomes 32760);
1: taxicab (L1); 2: euclidean (L2); p > 2: p-norm. A zero vector stays zero.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

INT16_SCALE = 32760.0
"""Max-abs normalization maps the largest magnitude to this value (llama.cpp's choice)."""


def check_normalize(mode: int) -> int:
    """`mode` if it is a valid normalization, else ValueError."""
    if isinstance(mode, bool) or not isinstance(mode, int) or mode < -1:
        raise ValueError(f"normalization must be an integer >= -1, got {mode!r}")
    return mode


def norms(vectors: npt.NDArray[np.floating], mode: int) -> npt.NDArray[np.float64]:
    """The divisor of each row of `vectors` (N, D) under normalization `mode`."""
    x = np.asarray(vectors, dtype=np.float64)
    if mode == -1:
        return np.ones(x.shape[:-1])
    if mode == 0:
        return np.abs(x).max(axis=-1) / INT16_SCALE
    if mode == 2:
        return np.sqrt((x * x).sum(axis=-1))
    return np.power(np.power(np.abs(x), mode).sum(axis=-1), 1.0 / mode)


def normalize(vectors: npt.ArrayLike, mode: int) -> npt.NDArray[np.float32]:
    """Rows of `vectors` (N, D) or one vector (D,) normalized with llama-server's `mode`."""
    check_normalize(mode)
    x = np.asarray(vectors, dtype=np.float32)
    if mode == -1:
        return x.copy()
    divisor = norms(x, mode)
    scale = np.where(divisor > 0, 1.0 / np.where(divisor > 0, divisor, 1.0), 0.0)
    return (x * scale[..., None]).astype(np.float32)
