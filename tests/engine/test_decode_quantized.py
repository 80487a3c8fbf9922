"""The native quantized decode linear (engine/native/decode_quantized.cpp) and where it is used."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from native_ops import decode_groups, native_op, random, runner_for, samples_by_setting

from engine import native
from engine.native_ops import DECODE_QUANTIZED_MAX_ROWS
from engine.sampling import SamplingParams
from engine.testing import tiny_model

ISAS = ("portable", "avx2", "avx512")


def kernel():
    return native_op("decode_quantized_linear")




def quantized(out, k, bits, group_size, dtype=mx.float16, seed=0):
    """MLX's quantization of a random (out, k) weight: (w, scales, biases)."""
    weight = mx.array(random((out, k), seed)).astype(dtype)
    return mx.quantize(weight, group_size=group_size, bits=bits)


def reference_weights(w, scales, biases, group_size, bits) -> np.ndarray:
    """The dequantized weights in float64 from MLX's layout, read here independently: each
    uint32 packs 32 / bits values, lowest bits first; w = scale * q + bias per group."""
    words = np.array(w).astype(np.uint64)
    per_word = 32 // bits
    shifts = (np.arange(per_word) * bits).astype(np.uint64)
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)
    s = np.array(scales.astype(mx.float32)).astype(np.float64)
    b = np.array(biases.astype(mx.float32)).astype(np.float64)
    return np.repeat(s, group_size, 1) * q + np.repeat(b, group_size, 1)


def forced(isa):
    """Force a path for a block of calls; skip where this CPU lacks it."""

    class Forced:
        def __enter__(self):
            try:
                native.set_decode_quantized_isa(isa)
            except ValueError as error:
                pytest.skip(str(error))

        def __exit__(self, *exc):
            native.set_decode_quantized_isa("auto")

    return Forced()


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 64),
                                             (8, 128)])
def test_the_layout_read_here_is_mlx_dequantize(bits, group_size):
    w, s, b = quantized(40, 256, bits, group_size, mx.float32)
    ours = reference_weights(w, s, b, group_size, bits)
    theirs = np.array(mx.dequantize(w, s, b, group_size=group_size, bits=bits))
    assert np.abs(ours - theirs).max() <= 1e-6 * np.abs(ours).max()


# Tails: outputs not a multiple of any path's tile (3, 2), in = one group, rows over 8.
SHAPES = [(1, 576, 576), (5, 576, 192), (13, 128, 7), (9, 32, 1), (3, 64, 50), (17, 256, 11)]
COMBOS = [(bits, gs, dtype) for bits in (4, 8) for gs in (32, 64, 128)
          for dtype in (mx.float16, mx.bfloat16, mx.float32)]


@pytest.mark.parametrize("rows,k,n,bits,group_size,dtype",
                         [shape + combo for shape in SHAPES for combo in COMBOS
                          if shape[1] % combo[1] == 0])
def test_matches_a_float64_reference(rows, k, n, bits, group_size, dtype):
    op = kernel()
    w, s, b = quantized(n, k, bits, group_size, dtype, seed=rows + k)
    wd = reference_weights(w, s, b, group_size, bits)
    x = random((rows, k), 1)
    out = np.array(op(mx.array(x), w, s, b, group_size, bits))
    ref = x.astype(np.float64) @ wd.T
    assert out.shape == (rows, n) and out.dtype == np.float32
    # float32 sums of k products (and each weight rounded once to float32)
    scale = np.abs(x).max() * np.abs(wd).max() * k
    assert np.abs(out - ref).max() <= 4e-7 * scale + 1e-6


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64), (4, 128)])
def test_is_close_to_mlx_quantized_matmul_and_keeps_leading_dimensions(bits, group_size):
    op = kernel()
    w, s, b = quantized(1536, 512, bits, group_size)
    x = mx.array(random((1, 5, 512), 2))
    out = op(x, w, s, b, group_size, bits)
    theirs = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group_size, bits=bits)
    assert out.shape == (1, 5, 1536)
    assert mx.allclose(out, theirs, rtol=1e-4, atol=1e-4).item()


@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("rows,k,n", [(11, 576, 1536), (8, 128, 7), (3, 1536, 576)])
def test_a_row_gets_the_same_bits_alone_and_with_any_company(rows, k, n, bits, group_size):
    op = kernel()
    w, s, b = quantized(n, k, bits, group_size, seed=3)
    x = random((rows, k), 4)
    together = np.array(op(mx.array(x), w, s, b, group_size, bits))
    for i in range(rows):
        alone = np.array(op(mx.array(x[i:i + 1]), w, s, b, group_size, bits))[0]
        assert np.array_equal(alone, together[i]), i
    others = random((33, k), 5)  # another place, in a larger call
    others[19] = x[0]
    assert np.array_equal(np.array(op(mx.array(others), w, s, b, group_size, bits))[19],
                          together[0])


@pytest.mark.parametrize("isa", ISAS[1:])
@pytest.mark.parametrize("bits,group_size,dtype", COMBOS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 10])  # no buffer: AVX2 <= 2 rows, AVX-512 <= 8
def test_every_instruction_set_gives_the_portable_bits(isa, bits, group_size, dtype, rows):
    w, s, b = quantized(77, 256, bits, group_size, dtype, seed=6)
    assert_portable_bits(isa, mx.array(random((rows, 256), 7)), w, s, b, group_size, bits)


def assert_portable_bits(isa, x, w, s, b, group_size, bits):
    """The kernel on path `isa` gives the portable path's bits."""
    op = kernel()
    with forced("portable"):
        expected = np.array(op(x, w, s, b, group_size, bits))
    with forced(isa):
        assert native.decode_quantized_isa() == isa
        got = np.array(op(x, w, s, b, group_size, bits))
    assert np.array_equal(got, expected)


# A tile converts its outputs' scales in one pass: 576 inputs in groups of 32 leave a tail of
# 8 after the 16-wide conversions, and 8192 of them more than the tile keeps on its stack.
@pytest.mark.parametrize("isa", ISAS[1:])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (4, 64)])
@pytest.mark.parametrize("k", [576, 8192])
@pytest.mark.parametrize("rows", [1, 3])
def test_every_instruction_set_gives_the_portable_bits_at_any_width(isa, bits, group_size, k,
                                                                    rows):
    w, s, b = quantized(37, k, bits, group_size, seed=8)
    assert_portable_bits(isa, mx.array(random((rows, k), 9)), w, s, b, group_size, bits)


def test_the_picked_path_is_the_best_this_cpu_has():
    kernel()
    have = []
    for isa in ISAS:
        try:
            assert native.set_decode_quantized_isa(isa) == isa
            have.append(isa)
        except ValueError:
            pass
    assert native.set_decode_quantized_isa("auto") == have[-1]
    assert "portable" in have
    assert native.decode_quantized_isa() == have[-1]
    with pytest.raises(ValueError, match="unknown path"):
        native.set_decode_quantized_isa("sse9")


THREADS_SCRIPT = """
import sys
import mlx.core as mx
import numpy as np
import engine
from engine import native
rng = np.random.default_rng(0)
x = mx.array(rng.standard_normal((11, 576)).astype(np.float32))
w, s, b = mx.quantize(mx.array(rng.standard_normal((1536, 576)).astype(np.float32)), 32, 4)
op = native.decode_quantized_linear()
# 11 rows (through the per-thread buffer) and 3 (dequantized in registers on AVX-512)
np.save(sys.argv[1], np.concatenate([np.array(op(x, w, s, b, 32, 4)),
                                     np.array(op(x[:3], w, s, b, 32, 4))]))
print(native.decode_quantized_isa())
"""


def test_the_thread_count_and_the_isa_variable_do_not_change_the_bits(tmp_path):
    """BATCHSCOPE_NATIVE_THREADS=1 against a pool of 3 and of 8 (more threads than this
    machine's cores: a preempted thread's share is finished by the others); and
    BATCHSCOPE_QUANTIZED_ISA=portable."""
    kernel()
    outs, isas = [], []
    for threads, isa in (("1", ""), ("3", ""), ("3", "portable"), ("8", "")):
        path = tmp_path / f"out{threads}{isa}.npy"
        env = {**os.environ, "BATCHSCOPE_NATIVE_THREADS": threads,
               "BATCHSCOPE_QUANTIZED_ISA": isa}
        done = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(path)], env=env,
                              check=True, capture_output=True, text=True)
        outs.append(np.load(path))
        isas.append(done.stdout.strip())
    assert isas[2] == "portable"
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    assert np.array_equal(outs[0], outs[3])


def test_refuses_bad_inputs_before_running():
    op = kernel()
    w, s, b = quantized(8, 64, 4, 32)
    x = mx.zeros((2, 64))
    cases = [
        ((x, w, s, b, 32, 3), "bits must be 4 or 8"),
        ((x, w, s, b, 16, 4), "group_size must be 32, 64 or 128"),
        ((x.astype(mx.float16), w, s, b, 32, 4), "x must be float32"),
        ((x.astype(mx.bfloat16), w, s, b, 32, 4), "x must be float32"),
        ((x, w.astype(mx.int32), s, b, 32, 4), "w must be uint32"),
        ((x, w, s.astype(mx.int32), b, 32, 4), "scales must be float16"),
        ((x, w, s, b.astype(mx.float32), 32, 4), "biases must have the scales' dtype"),
        ((mx.zeros((2, 48)), w, s, b, 32, 4), "multiple of group_size"),
        ((mx.zeros((2, 96)), w, s, b, 32, 4), "does not hold 96 4-bit values"),
        ((x, w, s, b, 32, 8), "does not hold 64 8-bit values"),
        ((x, w, s, b, 64, 4), r"scales \(8, 2\) must be"),
        ((x, w, s, b[:4], 32, 4), "biases .* must have the scales' shape"),
        ((x, w[0], s, b, 32, 4), "x must be"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*args)


# ---- in the model runner ----------------------------------------------------------------------



def count_calls(runner):
    calls = []
    real = runner.quantized_kernel

    def counting(x, *q):
        calls.append((x.shape[1], q[4]))
        return real(x, *q)

    runner.quantized_kernel = counting
    return calls




def test_gemm_and_tiled_steps_of_a_4bit_model_take_the_kernel_and_gemv_not():
    kernel()
    loaded = tiny_model()  # 4-bit linears, tied head (quantized with them)
    model = loaded.model
    runner = runner_for(model)
    assert runner.native_quantized_applies and not runner.native_matmul_applies
    # The layers op by op: the fused layer runs these kernels inside one op of its own
    # (tests/engine/test_decoder_layer.py).
    runner.layer_kernel = None
    calls = count_calls(runner)
    prefill, decode = decode_groups([30, 12, 25])
    runner.run(prefill)  # 67 rows, under DECODE_QUANTIZED_MAX_ROWS
    assert 67 <= DECODE_QUANTIZED_MAX_ROWS
    layers = len(model.model.layers)
    head = isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    # Per layer: q/k/v stacked into one call, o, gate/up stacked, down.
    assert calls[:4 * layers] == [(67, 4)] * (4 * layers)
    calls.clear()
    runner.run(decode)  # 3 decode rows: every linear layer, and the tied head
    assert calls == [(3, 4)] * (4 * layers) + [(3, 4)] * head
    calls.clear()
    runner.run(decode, path="gemv")  # the row-wise path stays on MLX's quantized_matmul
    assert calls == []
    runner.run(decode, path="tiled")  # --batch-invariant: the kernel computes each row alone
    assert calls == [(3, 4)] * (4 * layers) + [(3, 4)] * head


def test_the_setting_mlx_keeps_mlx_and_native_tokens_follow_it():
    """Same greedy tokens as MLX's quantized_matmul, logprobs within float32 noise."""
    kernel()
    model = tiny_model().model
    for setting in ("native", "mlx"):
        assert (runner_for(model, setting).quantized_kernel is None) == (setting == "mlx")
    results = samples_by_setting(model)
    for seq, (token, logprob) in results["native"].items():
        mlx_token, mlx_logprob = results["mlx"][seq]
        assert token == mlx_token
        assert abs(logprob - mlx_logprob) < 1e-4


@pytest.mark.parametrize("quantize", [True, False])
def test_stacked_projections_give_the_bits_of_one_call_each_and_add_no_memory(quantize):
    """Step.linears (q/k/v, gate/up) as one native call over the stacked weights: each output
    sums its own weights only, so the bits are those of a call per layer. Quantized layers'
    weights become views of the stacked ones (no memory added); float32 ones add the
    kernel's packed copy, once. Biases (qwen2's q/k/v) are added per layer."""
    (native_op("decode_quantized_linear") if quantize else native_op("decode_linear"))
    runner = runner_for(tiny_model(quantize=quantize).model, "native")
    features = 512  # layers large enough that the allocator's rounding is noise next to them
    modules = []
    for i, out in enumerate((512, 256, 256)):
        layer = nn.Linear(features, out, bias=True)
        layer.weight = mx.array(random((out, features), 30 + i))
        layer.bias = mx.array(random((out,), 20 + i))
        modules.append(nn.QuantizedLinear.from_linear(layer, 32, 4) if quantize else layer)
    mx.eval([m.parameters() for m in modules])
    for rows in (1, 3, 8):
        x = mx.array(random((1, rows, features), rows))
        separate = [runner.linear(m, x) for m in modules]
        mx.eval(separate)
        before = mx.get_active_memory()
        stacked = runner.linears(modules, x)
        mx.eval(stacked)
        for a, b in zip(stacked, separate, strict=True):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
        del stacked, a, b  # the outputs: only the weights are counted
        grew = mx.get_active_memory() - before
        weights = sum(m.weight.nbytes for m in modules)
        packed = 0 if quantize or rows > 1 else weights  # made on the first call
        assert abs(grew - packed) < weights / 4, (grew, weights)
    assert runner.stacks[tuple(id(m) for m in modules)][1] == ("q" if quantize else "f32")
    # The row-wise path still calls each layer (MLX's own kernel).
    x = mx.array(random((1, 2, features), 99))
    for a, m in zip(runner.linears(modules, x, path="gemv"), modules, strict=True):
        assert mx.array_equal(a, runner.linear(m, x, path="gemv")).item()


def test_a_quantized_linear_with_bias_adds_it():
    op = kernel()
    layer = nn.QuantizedLinear(64, 10, bias=True, group_size=32, bits=4)
    layer.bias = mx.array(random((10,), 8))
    runner = runner_for(tiny_model().model, "native")
    x = mx.array(random((1, 4, 64), 9))
    out = runner.linear(layer, x)
    expected = op(x, layer.weight, layer.scales, layer.biases, 32, 4) + layer.bias
    assert mx.array_equal(out, expected).item()
    assert mx.allclose(out, layer(x), rtol=1e-4, atol=1e-4).item()


def test_eight_requests_batched_equal_each_alone_on_the_kernel(make_engine):
    """The 4-bit tiny model with the kernel: batching must not change a bit (logprobs too)."""
    kernel()
    prompts = ["a", "hello there", "The quick brown fox jumps", "0123456789" * 3, "x" * 47,
               "paged attention!", "zz", "once upon a time, in a land far away"]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    # No prefix caching: a cached prompt's tail is prefilled against the cache, and that
    # attention (not the linear layers) sums in another order than the whole prompt's.
    engine = make_engine(block_size=4, enable_prefix_caching=False)
    assert "native quantized kernel" in engine.row_kernels
    assert native.decode_quantized_isa() in engine.row_kernels

    def tokens(handle):
        return [(e.token_id, e.logprob) for e in handle if hasattr(e, "token_id")]

    alone = [tokens(engine.submit(p, params)) for p in prompts]
    handles = [engine.submit(p, params) for p in prompts]
    assert [tokens(h) for h in handles] == alone
    assert max(len(r.entries) for r in engine.steps.recent()) == len(prompts)
