"""The `mlxcel` subcommands, one module each (shipped as `mlxcel.commands`)."""
