"""The PyPI OpenBLAS (scipy-openblas32) under MLX's CPU backend, through a tiny built shim."""
