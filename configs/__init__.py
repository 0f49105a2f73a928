"""Shipped settings profiles (TOML), installed as `mlxcel.configs`."""
