"""SiLU on mlxcel's CPU kernel (cpu_kernels/activations.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.engine.cpu_kernels.activations import use_silu_kernel

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the CPU kernel is built for Linux's CPU backend only"
)


def _mlx_silu() -> object:
    return getattr(nn.silu, "mlxcel_original", nn.silu)


def test_kernel_silu_is_closer_to_the_exact_value_than_a_few_ulps(kernels: ModuleType) -> None:
    x = mx.random.normal((3, 70001), key=mx.random.key(0)) * 10  # a ragged tail of 16 lanes
    exact = np.array(x).astype(np.float64)
    exact = exact / (1 + np.exp(-exact))
    got = np.array(kernels.silu(x))
    keep = np.abs(exact) > 1e-30
    assert (np.abs(got - exact)[keep] / np.abs(exact[keep])).max() < 1e-6
    edges = mx.array([0.0, -0.0, 1e-30, 100.0, -100.0, 88.0, -87.0, float("inf")])
    np.testing.assert_allclose(
        np.array(kernels.silu(edges)), [0, 0, 5e-31, 100, 0, 88, 0, np.inf], atol=1e-30
    )
    strided = x[:, ::3]  # not row-contiguous: gathered first
    np.testing.assert_allclose(
        np.array(kernels.silu(strided)), np.array(kernels.silu(mx.array(np.array(strided)))), rtol=0
    )


def test_wrapper_routes_float32_to_the_kernel_and_the_rest_to_mlx(kernels: ModuleType) -> None:
    assert use_silu_kernel(kernels) and use_silu_kernel(kernels)  # idempotent
    original = nn.silu.mlxcel_original  # type: ignore[attr-defined]
    assert not hasattr(original, "mlxcel_original")
    x = mx.random.normal((4, 33), key=mx.random.key(1))
    assert mx.array_equal(nn.silu(x), kernels.silu(x))
    half = x.astype(mx.float16)
    assert mx.array_equal(nn.silu(half), original(half))

    @mx.compile
    def swiglu(gate: mx.array, up: mx.array) -> mx.array:  # as mlx-lm's MLPs compile it
        return nn.silu(gate) * up

    np.testing.assert_allclose(
        np.array(swiglu(x, x)), np.array(original(x) * x), rtol=1e-5, atol=1e-6
    )


def test_auto_policy_installs_it(
    kernels: ModuleType, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.engine.loading import load_model

    monkeypatch.setattr(nn, "silu", _mlx_silu())
    load_model(str(tiny_gguf), cpu_dtype="keep")
    assert not hasattr(nn.silu, "mlxcel_original")
    load_model(str(tiny_gguf), cpu_dtype="auto")
    assert hasattr(nn.silu, "mlxcel_original")
