"""Package layout: `commands/` ships as `mlxcel.commands` and `configs/` as `mlxcel.configs`."""

from setuptools import find_packages, setup

packages = find_packages(include=["mlxcel", "mlxcel.*"])
packages += ["mlxcel.commands"] + [f"mlxcel.commands.{p}" for p in find_packages("commands")]
packages += ["mlxcel.configs"]

setup(
    packages=packages,
    package_dir={"mlxcel.commands": "commands", "mlxcel.configs": "configs"},
    package_data={
        "mlxcel": ["py.typed"],
        "mlxcel.configs": ["*.toml"],
        "mlxcel.engine.cpu_kernels": ["*.cpp"],  # compiled on the user's machine
    },
)
