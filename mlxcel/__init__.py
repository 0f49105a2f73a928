"""mlxcel: a CLI-first local inference toolkit on MLX."""

__version__ = "0.1.0"
