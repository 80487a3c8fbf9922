from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.config import KernelPolicy
from engine.kernels import apply_linear


def test_policy_paths():
    assert KernelPolicy("gemm").path_for(1) == "gemm"
    assert KernelPolicy("gemv").path_for(100) == "gemv"
    auto = KernelPolicy("auto", threshold=4)
    assert [auto.path_for(n) for n in (1, 4, 5, 124)] == ["gemv", "gemv", "gemm", "gemm"]
    assert auto.describe() == "auto(T=4)"


@pytest.mark.parametrize("path", ["gemm", "gemv", "tiled"])
def test_every_path_computes_the_same_linear_map(path):
    mx.random.seed(0)
    layer = nn.Linear(64, 48)
    x = mx.random.normal((1, 21, 64))
    out = apply_linear(layer, x, path, tile=8)
    assert out.shape == (1, 21, 48)
    assert mx.allclose(out, layer(x), atol=1e-5).item()


@pytest.mark.parametrize("shape", [(576, 192), (1536, 576), (576, 1536)])
def test_tiled_rows_get_the_same_bits_whatever_else_is_in_the_call(shape):
    """The batch-invariant path: a row's result must not depend on the number, values or
    order of the other rows (OpenBLAS picks kernels by row count: plain calls do differ)."""
    mx.random.seed(1)
    layer = nn.Linear(*shape, bias=False)
    target = mx.random.normal((1, 1, shape[0]))
    alone = apply_linear(layer, target, "tiled", tile=16)[0, 0]
    for rows, position in ((2, 1), (7, 3), (16, 15), (40, 20), (100, 99)):
        others = mx.random.normal((1, rows, shape[0]))
        x = mx.concatenate([others[:, :position], target, others[:, position + 1:]], axis=1)
        assert mx.array_equal(apply_linear(layer, x, "tiled", tile=16)[0, position], alone).item()
