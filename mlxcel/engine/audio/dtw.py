"""Dynamic time warping for word timestamps, in numpy.

mlx-whisper aligns tokens to audio frames with a numba-compiled DTW whose first call compiles
for seconds. This one sweeps the cost matrix one anti-diagonal at a time (every cell of a
diagonal depends only on the two before it), so it needs no compiler and returns the same path:
on ties it prefers a step along the audio axis, then along the token axis, as the original does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

_DIAGONAL, _TOKEN, _FRAME = 0, 1, 2


def dtw(x: np.ndarray) -> np.ndarray:
    """The warping path through cost matrix `x` (tokens × frames) as a (2, L) index array."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, dtype=np.float32)
    trace = np.full((n + 1, m + 1), -1, dtype=np.int8)
    cost[0, 0] = 0.0
    for d in range(2, n + m + 1):
        i = np.arange(max(1, d - m), min(n, d - 1) + 1)
        j = d - i
        c0 = cost[i - 1, j - 1]
        c1 = cost[i - 1, j]
        c2 = cost[i, j - 1]
        pick_diagonal = (c0 < c1) & (c0 < c2)
        pick_token = ~pick_diagonal & (c1 < c0) & (c1 < c2)
        best = np.where(pick_diagonal, c0, np.where(pick_token, c1, c2))
        cost[i, j] = x[i - 1, j - 1] + best
        trace[i, j] = np.where(pick_diagonal, _DIAGONAL, np.where(pick_token, _TOKEN, _FRAME))
    return _backtrace(trace)


def _backtrace(trace: np.ndarray) -> np.ndarray:
    import numpy as np

    trace = trace.copy()
    trace[0, :] = _FRAME
    trace[:, 0] = _TOKEN
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    path: list[tuple[int, int]] = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        if step == _DIAGONAL:
            i, j = i - 1, j - 1
        elif step == _TOKEN:
            i -= 1
        elif step == _FRAME:
            j -= 1
        else:
            raise ValueError(f"broken DTW trace at ({i}, {j})")
    return np.array(path[::-1], dtype=np.int64).reshape(-1, 2).T
