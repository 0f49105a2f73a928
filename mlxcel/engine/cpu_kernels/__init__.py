"""mlxcel's CPU kernels for MLX: `build` compiles and loads them, `layers` puts them in a model."""
