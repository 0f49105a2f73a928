"""`--cpu-dtype`: float32 dequantizes quantized weights at load on the CPU backend."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def _quantized_layers(model: nn.Module) -> int:
    return sum(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()
    )


def test_float32_policy_dequantizes_and_keeps_the_logits(tiny_gguf: Path) -> None:
    from mlxcel.engine.loading import load_model

    kept = load_model(str(tiny_gguf), cpu_dtype="keep")
    widened = load_model(str(tiny_gguf), cpu_dtype="float32")
    assert _quantized_layers(kept.model) > 0
    assert _quantized_layers(widened.model) == 0
    assert "float32" in widened.info.quantization
    ids = mx.array([kept.tokenizer.encode("hello world")])
    a = np.array(kept.model(ids))
    b = np.array(widened.model(ids))
    np.testing.assert_allclose(a, b, atol=1e-3, rtol=1e-3)
    assert widened.info.num_parameters == kept.info.num_parameters
