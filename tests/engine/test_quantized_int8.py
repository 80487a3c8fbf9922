"""The int8-activation option of the native quantized linear (engine/native/quantized_int8.cpp):
its arithmetic against a float64 reference written here from the definition, its paths against
each other, and its distance from the float32 result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from native_ops import native_op, random
from test_decode_quantized import forced, quantized, reference_weights

from engine import native


def kernel():
    return native_op("decode_quantized_linear")


def int8_reference(x, w, scales, biases, group_size, bits, block=32) -> np.ndarray:
    """out = sum over groups of s * (sum over blocks of d * (q . xq)) + b * xs in float64, with
    x quantized as the kernel defines it, per block of min(32, group_size): d = max|x| / 127,
    xq = round-half-even(x * (127 / max|x|)) in float32; xs = the group's blocks' d * sum(xq),
    summed in order in float32."""
    x = np.asarray(x, np.float32)
    rows, k = x.shape
    block = min(block, group_size)
    groups, per = k // group_size, group_size // block
    xb = x.reshape(rows, k // block, block)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    parts = (d * xq.sum(-1).astype(np.float32)).astype(np.float32).reshape(rows, groups, per)
    xs = parts[..., 0]
    for i in range(1, per):
        xs = (xs + parts[..., i]).astype(np.float32)
    s = np.array(scales.astype(mx.float32)).astype(np.float64)
    b = np.array(biases.astype(mx.float32)).astype(np.float64)
    q = reference_weights(w, mx.ones_like(scales), mx.zeros_like(biases), group_size, bits)
    qb = q.reshape(q.shape[0], k // block, block)
    dots = np.einsum("rbk,nbk->rnb", xq.astype(np.float64), qb) * d.astype(np.float64)[:, None]
    dots = dots.reshape(rows, -1, groups, per).sum(-1)
    return (np.einsum("rng,ng->rn", dots, s) + np.einsum("ng,rg->rn", b, xs.astype(np.float64)))


# Tails: a row of packed weights that is not a whole number of 64-byte pairs (576 at 4 bits:
# 4.5 pairs), outputs not a multiple of the tile, one group, rows over the row tile.
SHAPES = [(1, 576, 96), (5, 576, 13), (13, 128, 7), (9, 32, 1), (3, 64, 50), (17, 1536, 11)]
COMBOS = [(bits, gs, dtype) for bits in (4, 8) for gs in (32, 64, 128)
          for dtype in (mx.float16, mx.bfloat16, mx.float32)]
CASES = [shape + combo for shape in SHAPES for combo in COMBOS if shape[1] % combo[1] == 0]


def run(x, w, s, b, gs, bits):
    out = kernel()(mx.array(x), w, s, b, gs, bits, int8_activations=True)
    return np.array(out)


@pytest.mark.parametrize("rows,k,n,bits,group_size,dtype", CASES)
def test_int8_activations_follow_their_definition(rows, k, n, bits, group_size, dtype):
    w, s, b = quantized(n, k, bits, group_size, dtype, seed=k + n)
    x = random((rows, k), rows)
    x[0, :group_size] = 0.0  # an all-zero group: d = 0, nothing divided by zero
    want = int8_reference(x, w, s, b, group_size, bits)
    got = run(x, w, s, b, group_size, bits)
    # float32 accumulation of exact integer dots: a few ulps of the terms' magnitude
    scale = np.abs(want).max() + 1e-6
    assert np.abs(got - want).max() <= 2e-6 * scale * np.sqrt(k / group_size + 16)


@pytest.mark.parametrize("rows,k,n,bits,group_size,dtype", CASES[::3])
def test_every_path_gives_the_same_bits_and_rows_are_alone(rows, k, n, bits, group_size, dtype):
    w, s, b = quantized(n, k, bits, group_size, dtype, seed=3)
    x = random((rows, k), 7)
    results = []
    for isa in ("portable", "avx512"):
        with forced(isa):
            results.append(run(x, w, s, b, group_size, bits))
            alone = np.concatenate([run(x[i:i + 1], w, s, b, group_size, bits)
                                    for i in range(rows)])
            np.testing.assert_array_equal(alone, results[-1])
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_stay_close_to_float32(bits):
    """Not the float32 result (that is the point of the option), but within what 8-bit
    activations lose: about 1/254 of a group's largest value per activation."""
    w, s, b = quantized(256, 576, bits, 64, mx.bfloat16, seed=1)
    x = random((4, 576), 2)
    exact = np.array(kernel()(mx.array(x), w, s, b, 64, bits))
    got = run(x, w, s, b, 64, bits)
    assert not np.array_equal(got, exact)
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 0.01, rel


def test_the_vnni_path_is_taken_where_the_cpu_has_it():
    kernel()
    with open("/proc/cpuinfo") as info:
        flags = info.read().split()
    if native.decode_quantized_isa() == "avx512" and {"avx512_vnni", "avx512bw"} <= set(flags):
        assert native.int8_activations_isa() == "avx512-vnni"
    with forced("portable"):
        assert native.int8_activations_isa() == "portable"


def int8_runner(model):
    from engine.model_runner import ModelRunner, pool_for
    from engine.models import family_for

    family = family_for(model)
    return ModelRunner(model, pool_for(family, 64, 16), "auto", "auto", family,
                       activations="int8")


def test_an_int8_engine_step_gives_each_row_its_alone_bits():
    """The option keeps the engine batch-invariant: four sequences decoding in one step get
    the token and logprob bits each gets in a step of its own (fused layers, head included),
    and not float32's."""
    from native_ops import decode_groups, runner_for

    from engine.testing import tiny_model

    kernel()
    model = tiny_model().model
    runner = int8_runner(model)
    assert runner.int8_activations
    prefill, decode = decode_groups([30, 12, 25, 3])
    runner.run(prefill)
    together = {k: (s[0].token_id, s[0].logprob) for k, s in runner.run(decode).samples.items()}
    alone = {}
    for i, group in enumerate(decode):
        solo = int8_runner(model)
        solo.run([prefill[i]])
        alone.update({k: (s[0].token_id, s[0].logprob)
                      for k, s in solo.run([group]).samples.items()})
    assert together == alone
    # the fused decoder layer's int8 linears: the bits of the op-by-op layers
    unfused = int8_runner(model)
    unfused.layer_kernel = None
    unfused.run(prefill)
    assert together == {k: (s[0].token_id, s[0].logprob)
                        for k, s in unfused.run(decode).samples.items()}
    f32 = runner_for(model)
    f32.run(prefill)
    floats = {k: s[0].logprob for k, s in f32.run(decode).samples.items()}
    assert floats != {k: v[1] for k, v in together.items()}


def test_int8_activations_are_refused_where_nothing_would_take_them():
    from engine.config import EngineConfig
    from engine.testing import tiny_model

    kernel()
    with pytest.raises(ValueError, match="activations must be one of float32, int8"):
        EngineConfig(activations="int4")
    with pytest.raises(ValueError, match="applies to affine 4/8-bit weights"):
        int8_runner(tiny_model(quantize=False).model)
    from engine.model_runner import ModelRunner, pool_for
    from engine.models import family_for

    model = tiny_model().model
    with pytest.raises(ValueError, match="runs on the native quantized kernel"):
        ModelRunner(model, pool_for(family_for(model), 64, 16), "auto", "mlx",
                    activations="int8")
