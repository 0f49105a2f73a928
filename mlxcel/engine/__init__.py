"""The engine: loading, scheduling, sampling, caches, parsers; no HTTP, no CLI.

Importing it first loads a system OpenBLAS for MLX's CPU backend where one is installed
(see `mlxcel.engine.blas`), so it must happen before `mlx.core` is imported, and keeps
mlx-lm from changing the open-file limit when it is imported (`mlxcel.engine.file_limit`).
"""

from mlxcel.engine.blas import use_system_blas
from mlxcel.engine.file_limit import keep_file_limit

use_system_blas()
keep_file_limit()
