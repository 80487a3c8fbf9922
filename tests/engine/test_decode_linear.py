"""The native float32 decode linear (engine/native/decode_linear.cpp) and where it is used."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from native_ops import decode_groups, native_op, random, runner_for, samples_by_setting

from engine import native
from engine.native_ops import DECODE_MATMUL_MAX_ROWS
from engine.testing import tiny_model


def native_linear():
    """x, weight (out, in) -> x @ weight.T on the native kernel (packing the weight first)."""
    op = native_op("decode_linear")
    pack = native.pack_linear_weight()

    def linear(x, weight, isa="auto"):
        return op(x, pack(weight), weight.shape[0], isa=isa)

    return linear


def built_paths() -> list[str]:
    """The instruction-set paths this build of the float32 kernel has: those it takes (it
    refuses the others by name)."""
    op, w = native_op("decode_linear"), native.pack_linear_weight()(mx.zeros((1, 1)))
    paths = []
    for isa in ("avx512", "avx2", "portable"):
        try:
            op(mx.zeros((1, 1)), w, 1, isa=isa)
        except ValueError as error:
            assert f"has no {isa} path" in str(error)
        else:
            paths.append(isa)
    return paths


# Shapes of SmolLM2's layers, and odd ones that exercise every tail: rows not a multiple of any
# path's tile (6, 2 or 4 rows), outputs not a multiple of the 64-output panel or of a 16-output
# vector, in_features of any size.
SHAPES = [(1, 576, 576), (3, 576, 1536), (16, 1536, 576), (8, 576, 192), (13, 37, 7),
          (7, 100, 49), (2, 17, 3), (1, 1, 1), (9, 576, 4099), (37, 64, 80)]


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_matches_a_float64_reference(rows, k, n):
    op = native_linear()
    x, w = random((rows, k), 1), random((n, k), 2)
    out = np.array(op(mx.array(x), mx.array(w)))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert out.shape == (rows, n)
    # float32 sums of k products: a few ulps of the largest partial sum
    scale = np.abs(x).max() * np.abs(w).max() * k
    assert np.abs(out - ref).max() <= 4e-7 * scale + 1e-6


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_each_output_is_one_fused_multiply_add_chain_in_k_order(rows, k, n):
    """The kernel's arithmetic, written out: fma(x[k], w[k], s) from k = 0 with s = 0, each
    step rounded once to float32 (numpy's float64 product and sum of two float32s is exact,
    so rounding it to float32 is the fused multiply-add's rounding)."""
    op = native_linear()
    x, w = random((rows, k), 11), random((n, k), 12)
    out = np.array(op(mx.array(x), mx.array(w)))
    expected = np.zeros((rows, n), dtype=np.float32)
    for j in range(k):
        exact = x[:, j:j + 1].astype(np.float64) * w[:, j].astype(np.float64)
        expected = (exact + expected.astype(np.float64)).astype(np.float32)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_every_instruction_set_path_gives_the_same_bits(rows, k, n):
    op = native_linear()
    x, w = mx.array(random((rows, k), 13)), mx.array(random((n, k), 14))
    outs = {isa: np.array(op(x, w, isa=isa)) for isa in built_paths()}
    assert "portable" in outs
    for isa, out in outs.items():
        assert np.array_equal(out, outs["portable"]), isa


@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_a_row_gets_the_same_bits_alone_and_with_any_company(rows, k, n):
    op = native_linear()
    x, w = random((rows, k), 3), mx.array(random((n, k), 4))
    together = np.array(op(mx.array(x), w))
    for i in range(rows):
        alone = np.array(op(mx.array(x[i:i + 1]), w))[0]
        assert np.array_equal(alone, together[i]), i
    # the same row at another place among other rows, in a call with more rows
    others = random((DECODE_MATMUL_MAX_ROWS, k), 5)
    others[11] = x[0]
    assert np.array_equal(np.array(op(mx.array(others), w))[11], together[0])


def test_keeps_leading_dimensions_and_is_close_to_mlx_matmul():
    op = native_linear()
    x, w = mx.array(random((1, 5, 576), 6)), mx.array(random((1536, 576), 7))
    out = op(x, w)
    assert out.shape == (1, 5, 1536)
    assert mx.allclose(out, x @ w.T, rtol=1e-5, atol=1e-4).item()


def test_the_packed_layout_is_panels_of_64_outputs_k_major_zero_past_the_last():
    pack = native_op("pack_linear_weight")
    w = random((70, 5), 15)
    packed = np.array(pack(mx.array(w)))
    assert packed.shape == (2, 5, 64)
    assert np.array_equal(packed[0], w[:64].T)
    assert np.array_equal(packed[1, :, :6], w[64:].T) and not packed[1, :, 6:].any()


def test_two_threads_calling_at_once_both_get_their_results():
    """The worker pool serves one caller at a time; the other computes on its own thread."""
    op = native_linear()
    w = mx.array(random((4096, 576), 8))
    inputs = [mx.array(random((6, 576), 10 + i)) for i in range(2)]
    expected = [np.array(op(x, w)) for x in inputs]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(20):
                out = np.array(op(inputs[i], w))
                if not np.array_equal(out, expected[i]):
                    results[i] = False
                    return
            results[i] = True
        except Exception as error:  # noqa: BLE001  (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == {0: True, 1: True}


def test_refuses_other_dtypes_and_mismatched_shapes():
    op, linear = native_op("decode_linear"), native_linear()
    pack = native.pack_linear_weight()
    with pytest.raises(ValueError, match="disagree on in_features"):
        linear(mx.zeros((2, 5)), mx.zeros((3, 4)))
    with pytest.raises(ValueError, match="only float32"):
        pack(mx.zeros((3, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match="only float32"):
        op(mx.zeros((2, 4), dtype=mx.float16), pack(mx.zeros((3, 4))), 3)
    with pytest.raises(ValueError, match=r"weight must be \(out, in\)"):
        pack(mx.zeros((4,)))
    with pytest.raises(ValueError, match=r"not packed for 65 outputs.*\(2, in, 64\)"):
        op(mx.zeros((2, 4)), pack(mx.zeros((3, 4))), 65)
    with pytest.raises(ValueError, match=r"not packed for 3 outputs"):
        op(mx.zeros((2, 4)), mx.zeros((3, 4)), 3)  # a weight as the layer holds it
    with pytest.raises(ValueError, match="unknown path 'sse'"):
        op(mx.zeros((2, 4)), pack(mx.zeros((3, 4))), 3, isa="sse")


def test_row_kernels_setting_is_checked():
    from engine.config import EngineConfig
    from engine.native_ops import matmul_kernel

    with pytest.raises(ValueError, match="row_kernels must be one of"):
        EngineConfig(row_kernels="fast")
    assert matmul_kernel("mlx", fused=False) is None
    assert matmul_kernel("auto", fused=True) is None  # GPU: MLX's matmul
    with pytest.raises(ValueError, match="CPU backend only"):
        matmul_kernel("native", fused=True)


# ---- in the model runner ----------------------------------------------------------------------



def count_native_calls(runner):
    calls = []
    real = runner.matmul_kernel

    def counting(x, *weight):
        calls.append(x.shape[1])
        return real(x, *weight)

    runner.matmul_kernel = counting
    return calls




def test_few_row_float32_gemm_steps_take_the_kernel_and_others_do_not():
    native_linear()
    model = tiny_model(quantize=False).model
    runner = runner_for(model, "auto")
    # The layers op by op: the fused layer runs these kernels inside one op of its own
    # (tests/engine/test_decoder_layer.py).
    runner.layer_kernel = None
    calls = count_native_calls(runner)
    prefill, decode = decode_groups([30, 12, 25])
    runner.run(prefill)  # 67 rows: MLX's matmul
    assert calls == []
    runner.run(decode)  # 3 decode rows: every linear layer, and the tied lm_head
    layers = len(model.model.layers)
    # Per layer: q/k/v stacked into one call, o, gate/up stacked, down; then the head.
    assert calls == [3] * (4 * layers + 1)
    calls.clear()
    runner.run(decode, path="gemv")  # the row-wise path stays on MLX's matmul
    assert calls == []


def test_batch_invariant_float32_steps_take_the_kernel_in_calls_of_its_row_limit():
    """--batch-invariant ("tiled"): every step takes the kernel, which computes each row
    alone, a 67-row prefill too, cut into calls of at most DECODE_MATMUL_MAX_ROWS rows."""
    native_linear()
    model = tiny_model(quantize=False).model
    runner = runner_for(model, "auto")
    runner.layer_kernel = None
    calls = count_native_calls(runner)
    prefill, _ = decode_groups([30, 12, 25])
    runner.run(prefill, path="tiled")
    layers = len(model.model.layers)
    assert DECODE_MATMUL_MAX_ROWS == 32
    # Per layer: q/k/v stacked, o, gate/up stacked, down, in 32 + 32 + 3 rows (no row is
    # sampled: no head).
    assert calls == [32, 32, 3] * (4 * layers)


def test_quantized_weights_keep_mlx_matmul():
    native_linear()
    runner = runner_for(tiny_model().model, "auto")  # 4-bit
    calls = count_native_calls(runner)
    prefill, decode = decode_groups([10, 5])
    runner.run(prefill)
    runner.run(decode)
    assert calls == [] and not runner.native_matmul_applies


def test_decode_tokens_and_logprobs_follow_mlx_matmul_closely():
    """Same greedy tokens as MLX's matmul on the tiny model, logprobs within float32 noise."""
    native_linear()
    results = samples_by_setting(tiny_model(quantize=False).model)
    for seq, (token, logprob) in results["native"].items():
        mlx_token, mlx_logprob = results["mlx"][seq]
        assert token == mlx_token
        assert abs(logprob - mlx_logprob) < 1e-4


def test_linear_with_bias_adds_it():
    op = native_linear()
    layer = nn.Linear(24, 10, bias=True)
    mx.eval(layer.parameters())
    model = tiny_model(quantize=False).model
    runner = runner_for(model, "native")
    x = mx.array(random((1, 4, 24), 9))
    out = runner.linear(layer, x)
    assert mx.array_equal(out, op(x, layer.weight) + layer.bias).item()
    assert mx.allclose(out, layer(x), rtol=1e-5, atol=1e-5).item()


THREADS_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import engine
from engine import native
rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((11, 576)).astype(np.float32))
w = mx.array(rng.standard_normal((1536, 576)).astype(np.float32))
np.save(sys.argv[1], np.array(native.decode_linear()(x, native.pack_linear_weight()(w), 1536)))
"""


def test_the_thread_count_does_not_change_the_bits(tmp_path):
    """BATCHSCOPE_NATIVE_THREADS=1 (the calling thread only) against the default pool."""
    import subprocess
    import sys

    native_linear()
    outs = []
    for threads in ("1", "3"):
        path = tmp_path / f"out{threads}.npy"
        env = {**os.environ, "BATCHSCOPE_NATIVE_THREADS": threads}
        subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(path)], env=env, check=True)
        outs.append(np.load(path))
    assert np.array_equal(outs[0], outs[1])

