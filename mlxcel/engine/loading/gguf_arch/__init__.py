"""The GGUF architectures mlxcel loads, one small file each (mapping tables and the
hyper-parameters their mlx-lm class needs); `find_architecture` picks one by name."""

from __future__ import annotations

from mlxcel.engine.loading.gguf_arch import gemma3, llama, qwen2, qwen3
from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    module.ARCHITECTURE.name: module.ARCHITECTURE for module in (llama, qwen2, qwen3, gemma3)
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def find_architecture(name: str) -> GGUFArchitecture:
    """The architecture `name` (`general.architecture`); ValueError naming the supported
    ones when mlxcel cannot build it."""
    found = ARCHITECTURES.get(name)
    if found is None:
        raise ValueError(
            f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return found


__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "ArchMetadata",
    "GGUFArchitecture",
    "find_architecture",
]
