"""GEMM vs row-wise GEMV on the real model: identical where the backend computes rows alone,
a measured difference where it does not. Slow: loads the embedded model twice per format."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.platform import blas_loaded
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def run(weights: str, policy: str, row_kernels: str = "auto") -> list:
    config = EngineConfig(weights=weights, kernel_policy=policy, num_kv_blocks=64,
                          row_kernels=row_kernels)
    with Engine(config).start() as engine:
        handle = engine.submit(PROMPT, SamplingParams(max_tokens=16, logprobs=2, ignore_eos=True))
        tokens = [e for e in handle if hasattr(e, "token_id")]
        # gemm steps where the native kernels take every layer (all steps here are at most 32
        # rows) are recorded native: each row computed alone.
        runner = engine.runner
        native = runner.native_matmul_applies or runner.native_quantized_applies
        expected = "native" if policy == "gemm" and native else policy
        assert {r.kernel_path for r in engine.steps.recent()} == {expected}
    return tokens


def max_delta_while_equal(a: list, b: list) -> float:
    delta = 0.0
    for x, y in zip(a, b, strict=True):
        delta = max(delta, abs(x.logprob - y.logprob))
        if x.token_id != y.token_id:
            break
    return delta


def test_four_bit_cpu_paths_are_bit_identical():
    """On MLX's quantized_matmul for both paths: it computes each row alone."""
    gemm, gemv = run("q4", "gemm", "mlx"), run("q4", "gemv", "mlx")
    assert [t.token_id for t in gemm] == [t.token_id for t in gemv]
    assert max_delta_while_equal(gemm, gemv) == 0.0


def test_four_bit_native_gemm_follows_mlx_gemv_within_rounding():
    """gemm steps take the native quantized kernel, the gemv path keeps MLX's: both compute
    each row alone, in other summation orders, so the logprobs differ by rounding only."""
    gemm, gemv = run("q4", "gemm"), run("q4", "gemv")
    assert [t.token_id for t in gemm] == [t.token_id for t in gemv]
    assert max_delta_while_equal(gemm, gemv) < 1e-3


def test_float32_paths_differ_with_an_optimized_blas():
    gemm, gemv = run("f32", "gemm"), run("f32", "gemv")
    delta = max_delta_while_equal(gemm, gemv)
    if blas_loaded():
        # OpenBLAS sums a GEMM in another order than a GEMV (docs/kernel-paths.md: ~5e-5 in
        # the logits).
        assert 0.0 < delta < 1e-3, delta
    else:
        assert delta == 0.0, delta  # the reference BLAS computes rows alike
