"""The engine: loading, scheduling, sampling, caches, parsers; no HTTP, no CLI.

Importing it first loads a system OpenBLAS for MLX's CPU backend where one is installed
(see `mlxcel.engine.blas`), so it must happen before `mlx.core` is imported.
"""

from mlxcel.engine.blas import use_system_blas

use_system_blas()
