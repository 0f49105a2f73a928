"""The GGUF architectures mlxcel loads, one small file each (mapping tables and the
hyper-parameters their mlx-lm class needs); `find_architecture` picks one by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxcel.engine.loading.gguf_arch import (
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    granitemoe,
    llama,
    mistral3,
    olmo2,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smollm3,
)
from mlxcel.engine.loading.gguf_arch.base import ArchMetadata, GGUFArchitecture

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    module.ARCHITECTURE.name: module.ARCHITECTURE
    for module in (
        llama,
        qwen2,
        qwen3,
        gemma3,
        gemma2,
        phi3,
        qwen2moe,
        qwen3moe,
        olmo2,
        granite,
        granitemoe,
        smollm3,
        gpt_oss,
        mistral3,
    )
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def find_architecture(name: str, metadata: Mapping[str, Any] | None = None) -> GGUFArchitecture:
    """The architecture `name` (`general.architecture`), the variant the file's `metadata`
    asks for (experts); ValueError naming the supported ones when mlxcel cannot build it."""
    found = ARCHITECTURES.get(name)
    if found is None:
        raise ValueError(
            f"unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return found if metadata is None else found.for_file(metadata)


__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "ArchMetadata",
    "GGUFArchitecture",
    "find_architecture",
]
