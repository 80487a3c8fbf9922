from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import pytest
from native_ops import native_op

from engine.config import KernelPolicy
from engine.kernels import PathTaken, PathTally, apply_linear
from engine.native_ops import DECODE_MATMUL_MAX_ROWS
from engine.sampling import SamplingParams
from engine.testing import tiny_model


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


def test_a_step_is_native_only_where_every_call_took_a_native_kernel():
    gemm = PathTally("gemm", rows=40)
    gemm.took("native", 1)
    assert gemm.taken() == PathTaken("native", 1)
    gemm.took("gemm", 1)  # one call through MLX: its rows share blocking
    assert gemm.taken() == ("gemm", 1)
    tiled = PathTally("tiled", rows=40, tile=16)
    tiled.took("native", 2)
    tiled.took("tiled", 3)
    assert tiled.taken() == ("tiled", 3)
    # No call at all (a failed step): the planned path and the calls it would have made.
    assert PathTally("gemv", rows=5).taken() == ("gemv", 5)
    assert PathTally("tiled", rows=40, tile=16).taken() == ("tiled", 3)


def test_steps_on_the_native_kernels_record_native_and_mlx_matmul_steps_gemm(make_engine):
    """Float32 weights: a step of up to DECODE_MATMUL_MAX_ROWS rows runs every linear layer
    and the head on the native kernel (`native`); a longer prefill step runs its layers on the
    BLAS (`gemm`, though its one head row is native); --row-kernels mlx is `gemm` throughout,
    and the gemv policy `gemv`. With --batch-invariant every layer takes the native kernel in
    calls of at most its row limit: `native` again."""
    native_op("decode_linear")
    prompt = "x" * (DECODE_MATMUL_MAX_ROWS + 8)

    def steps(**config) -> set[tuple[int, str, int]]:
        engine = make_engine(loader=partial(tiny_model, quantize=False),
                             max_num_batched_tokens=64, **config)
        engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        return {(r.total_rows, r.kernel_path, r.linear_calls_per_layer)
                for r in engine.steps.recent()}

    default = steps()
    rows = sorted(n for n, _, _ in default)
    assert rows[0] == 1 and rows[-1] > DECODE_MATMUL_MAX_ROWS  # decode and one prefill step
    assert default == {(n, "native" if n <= DECODE_MATMUL_MAX_ROWS else "gemm", 1)
                       for n in rows}
    assert steps(row_kernels="mlx") == {(n, "gemm", 1) for n in rows}
    assert steps(kernel_policy="gemv") == {(n, "gemv", n) for n in rows}
    assert steps(batch_invariant=True) == {
        (n, "native", -(-n // DECODE_MATMUL_MAX_ROWS)) for n in rows}
