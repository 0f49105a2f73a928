"""MLX model directories whose config has rope_scaling (YaRN, Llama 3, LongRoPE): mlx-lm's
RoPE modules keep their frequencies outside the parameters, and the loaders evaluate them, so
the model runs on a thread other than the loading one (as the engine runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import pytest
from fixtures.generate_cli import greedy_cli_text
from fixtures.other_thread import on_another_thread
from fixtures.tiny_models import build_tiny_model
from server_harness import ServeProcess

from mlxcel.engine.loading import load_model

SCALINGS: dict[str, dict[str, Any]] = {
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "longrope": {  # head_dim 16: 8 factors each
        "rope_type": "longrope",
        "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
        "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.5],
        "original_max_position_embeddings": 512,
    },
}
PROMPT = "The cat sat on the mat"


@pytest.fixture(scope="module")
def scaled_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rope-scaling")
    return {
        name: build_tiny_model(root / name, "llama", rope_scaling=scaling)
        for name, scaling in SCALINGS.items()
    }


def _reference(model_dir: Path) -> tuple[Any, Any]:
    """mlx-lm's own model and tokenizer for the directory, used on this thread."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(model_dir))  # type: ignore[misc]
    return model, tokenizer


def _greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(mx.argmax(model(mx.array([tokens]))[0, -1]).item()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_a_loaded_directory_runs_on_another_thread(name: str, scaled_dirs: dict[str, Path]) -> None:
    """load_model on the directory, the forward on a fresh thread: mlx-lm's logits (MLX
    refused the lazy frequencies there: 'There is no Stream(cpu, 0) in current thread')."""
    loaded = load_model(str(scaled_dirs[name]))
    reference, tokenizer = _reference(scaled_dirs[name])
    inputs = mx.array([tokenizer.encode(PROMPT)])
    want = np.array(reference(inputs))
    got = on_another_thread(lambda: np.array(loaded.model(inputs)))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_generate_cli_answers_on_a_scaled_directory(
    name: str, scaled_dirs: dict[str, Path]
) -> None:
    """`mlxcel generate -m DIR` (the engine on its own thread): mlx-lm's greedy text."""
    model_dir = scaled_dirs[name]
    reference, tokenizer = _reference(model_dir)
    want = tokenizer.decode(_greedy(reference, tokenizer.encode(PROMPT), 5))
    assert greedy_cli_text(model_dir, PROMPT, 5) == want


def test_serve_answers_on_a_yarn_directory(scaled_dirs: dict[str, Path]) -> None:
    """`mlxcel serve -m DIR` with YaRN: /completion answers mlx-lm's greedy text."""
    model_dir = scaled_dirs["yarn"]
    reference, tokenizer = _reference(model_dir)
    want = tokenizer.decode(_greedy(reference, tokenizer.encode(PROMPT), 4))
    with ServeProcess(["-m", str(model_dir), "-np", "1", "-c", "512"]) as server:
        body = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(f"{server.url}/completion", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["tokens_predicted"] == 4
        assert answer.json()["content"] == want
