"""The native per-row ops (engine/native/row_ops.cpp): RMS norm and RoPE, and where they run."""

from __future__ import annotations

import io
import math
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from native_ops import native_op, random, runner_for

from engine.testing import tiny_model


def ops():
    return native_op("row_ops")


def norm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 7, 64), (3, 5, 48), (2, 9, 17)])
def test_rms_norm_matches_float64_and_mlx(shape):
    norm = ops()[0]
    x, w = random(shape, 1) * 3, random(shape[-1:], 2)
    out = norm(mx.array(x), mx.array(w), 1e-5)
    assert out.shape == shape and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), norm_reference(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    theirs = mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5)
    assert mx.abs(out - theirs).max().item() <= 1e-5 * np.abs(x).max() * np.abs(w).max()


def test_rms_norm_gives_a_row_the_same_bits_alone_and_with_others():
    norm = ops()[0]
    x, w = mx.array(random((1, 13, 96), 3)), mx.array(random((96,), 4))
    together = norm(x, w, 1e-6)
    for r in (0, 5, 12):
        assert mx.array_equal(norm(x[:, r:r + 1], w, 1e-6), together[:, r:r + 1]).item()


def rope_reference(x: np.ndarray, pos: np.ndarray, inv: np.ndarray, dims: int, traditional: bool,
                   scale: float) -> np.ndarray:
    out = x.astype(np.float64).copy()
    theta = (pos.astype(np.float64) * scale)[:, None] * inv.astype(np.float64)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    half = dims // 2
    a = np.arange(0, dims, 2) if traditional else np.arange(half)
    b = a + 1 if traditional else a + half
    xa, xb = x[..., a].astype(np.float64), x[..., b].astype(np.float64)
    out[..., a] = xa * c - xb * s
    out[..., b] = xa * s + xb * c
    return out


def default_inv_freqs(dims: int, base: float) -> mx.array:
    half = dims // 2
    return mx.exp(mx.arange(0.0, -half, -1.0) * (math.log(base) / half))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64), (16, 24)])
def test_rope_matches_float64_and_mlx(traditional, dims, head_dim):
    rope = ops()[1]
    x = random((5, 3, head_dim), 5)
    pos = np.array([0, 1, 37, 511, 4093], dtype=np.int32)
    inv = default_inv_freqs(dims, 10000.0)
    for scale in (1.0, 0.25):
        out = rope(mx.array(x), mx.array(pos), inv, dims, traditional, scale)
        # float32 angles of up to 4093 radians: cos and sin are good to ~4093 * 2^-24.
        np.testing.assert_allclose(np.array(out), rope_reference(x, pos, np.array(inv), dims,
                                                                 traditional, scale),
                                   atol=2e-3 * np.abs(x).max(), rtol=0)
        theirs = mx.fast.rope(mx.array(x)[:, :, None, :], dims, traditional=traditional,
                              base=10000.0, scale=scale, offset=mx.array(pos))[:, :, 0, :]
        assert mx.abs(out - theirs).max().item() <= 1e-5 * np.abs(x).max()
        assert mx.array_equal(out[..., dims:], mx.array(x)[..., dims:]).item()


def test_ops_refuse_bad_inputs():
    norm, rope, _ = ops()
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match="weight must be float32"):
        norm(x, mx.zeros((7,)), 1e-5)
    with pytest.raises(ValueError, match="x must be float32"):
        norm(x.astype(mx.float16), mx.zeros((8,)), 1e-5)
    q, pos = mx.zeros((2, 3, 8)), mx.array([0, 1], dtype=mx.int32)
    inv = default_inv_freqs(8, 10000.0)
    cases = [((q[0], pos, inv, 8, False, 1.0), "x must be float32 \\(rows, heads"),
             ((q, pos[:1], inv, 8, False, 1.0), "positions must be int32"),
             ((q, pos.astype(mx.float32), inv, 8, False, 1.0), "positions must be int32"),
             ((q, pos, inv, 7, False, 1.0), "dims must be even"),
             ((q, pos, inv, 10, False, 1.0), "dims must be even"),
             ((q, pos, inv[:2], 8, False, 1.0), "inv_freqs must be"), ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            rope(*args)


# ---- in the model runner ----------------------------------------------------------------------


def test_the_runner_takes_them_for_float32_rms_norms_and_plain_ropes():
    ops()
    from mlx_lm.models.rope_utils import Llama3RoPE, YarnRoPE

    model = tiny_model(quantize=False).model
    runner = runner_for(model, "auto")
    layer = model.model.layers[0]
    x = mx.array(random((1, 3, model.args.hidden_size), 6))
    native_out = runner.norm(layer.input_layernorm, x)
    assert mx.allclose(native_out, layer.input_layernorm(x), rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(native_out, runner.row_ops[0](x, layer.input_layernorm.weight,
                                                         layer.input_layernorm.eps)).item()
    q, k = mx.array(random((3, 4, 16), 7)), mx.array(random((3, 2, 16), 8))
    for rope in (nn.RoPE(16, traditional=True, base=500.0, scale=0.5),
                 Llama3RoPE(16, traditional=False, base=500000.0,
                            scaling_config={"factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})):
        assert runner.native_rope(rope, q, k) is not None
        pos = mx.array([0, 9, 300], dtype=mx.int32)
        op, inv, scale = runner.native_rope(rope, q, k)
        ours = op(q, pos, inv, rope.dims, rope.traditional, scale)
        theirs = rope(q[:, :, None, :], offset=pos)[:, :, 0, :]
        assert mx.abs(ours - theirs).max().item() < 1e-5
    yarn = YarnRoPE(16, base=10000.0, scaling_factor=4.0)
    assert runner.native_rope(yarn, q, k) is None  # scales q and k too: MLX's
    assert runner.native_rope(nn.RoPE(16), q.astype(mx.bfloat16), k) is None
    # "mlx" keeps MLX's ops for everything.
    plain = runner_for(model, "mlx")
    assert plain.row_ops is None and plain.native_rope(nn.RoPE(16), q, k) is None
    assert mx.array_equal(plain.norm(layer.input_layernorm, x), layer.input_layernorm(x)).item()


@pytest.mark.parametrize("shape,spread", [((16, 49152), 4.0), ((3, 1000), 30.0),
                                          ((1, 262144), 2.0), ((5, 17), 1.0)])
def test_logsumexp_has_mlx_logsumexp_bits(shape, spread):
    """The sampler's normalizer: the same bits as mx.logsumexp (the exps by its formula, the
    sum in its order), and so the same logprobs as mlx-lm's generation."""
    lse = ops()[2]
    x = mx.array(random(shape, 11) * spread)
    assert mx.array_equal(lse(x), mx.logsumexp(x, axis=-1)).item()
    x64 = np.array(x).astype(np.float64)
    top = x64.max(1)
    reference = top + np.log(np.exp(x64 - top[:, None]).sum(1))
    np.testing.assert_allclose(np.array(lse(x)), reference, rtol=1e-5)


def test_logsumexp_of_masked_rows_and_bad_input():
    lse = ops()[2]
    x = mx.array([[-np.inf] * 4, [0.0, -np.inf, 1.0, 2.0]], dtype=mx.float32)
    assert mx.array_equal(lse(x), mx.logsumexp(x, axis=-1)).item()
    for bad in (mx.zeros((4,)), mx.zeros((2, 3), dtype=mx.float16), mx.zeros((2, 0))):
        with pytest.raises(ValueError, match="x must be float32 \\(rows, V\\)"):
            lse(bad)


# ---- greedy sampling --------------------------------------------------------------------------


def same_bits(a: mx.array, b: mx.array) -> bool:
    view = mx.uint32 if a.dtype == mx.float32 else mx.uint16
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.array(a.view(view)), np.array(b.view(view)))


def sampler_ops(x: mx.array) -> tuple[mx.array, mx.array]:
    """What engine/sampler.py's draw computes for greedy rows without the op."""
    logprobs = x - ops()[2](x)[:, None]
    ids = mx.argmax(logprobs, axis=-1)
    return ids, mx.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]


@pytest.mark.parametrize("shape,spread", [((1, 49152), 4.0), ((16, 49152), 30.0),
                                          ((5, 17), 1.0)])
def test_greedy_rows_has_the_bits_of_the_sampler_ops(shape, spread):
    greedy = native_op("greedy")
    x = random(shape, 12) * spread
    x[0, 3] = x[0, 9] = x[0].max() + 1.0  # a tie for the largest: MLX's argmax takes the first
    if shape[0] > 1:
        x[-1, :] = 0.5  # a row of equal logits: token 0
    ids, lp = greedy(mx.array(x))
    want_ids, want_lp = sampler_ops(mx.array(x))
    assert ids.dtype == mx.uint32 and lp.dtype == mx.float32
    assert ids.tolist() == want_ids.tolist() and ids[0].item() == 3
    assert shape[0] == 1 or ids[-1].item() == 0
    assert same_bits(lp, want_lp)


def test_greedy_rows_refuses_bad_input():
    greedy = native_op("greedy")
    for bad in (mx.zeros((4,)), mx.zeros((2, 3), dtype=mx.float16), mx.zeros((2, 0))):
        with pytest.raises(ValueError, match="x must be float32 \\(rows, V\\)"):
            greedy(bad)


# ---- the quantized embedding ------------------------------------------------------------------


def quantized_embedding(dtype, bits: int, group_size: int, seed: int,
                        vocab: int = 300, dims: int = 256) -> nn.QuantizedEmbedding:
    """MLX's own quantized embedding of random rows whose sizes span 1e-3 to 30 (each row its
    own scale): the products and sums round in every magnitude the scales' type has."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((vocab, dims)) * rng.choice([1e-3, 1.0, 30.0], size=(vocab, 1))
    emb = nn.QuantizedEmbedding(vocab, dims, group_size=group_size, bits=bits)
    emb.weight, emb.scales, emb.biases = mx.quantize(mx.array(table, dtype), group_size, bits)
    return emb


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_embedding_has_mlx_dequantize_bits(dtype, bits, group_size):
    embed = native_op("quantized_embedding")
    emb = quantized_embedding(dtype, bits, group_size, seed=bits + group_size)
    ids = np.random.default_rng(1).integers(0, 300, 64)
    ids[5] = ids[9] = 299  # repeated, and the last row
    for id_type in (mx.int32, mx.uint32):  # a prompt's ids; a step's sampled tokens
        tokens = mx.array(ids).astype(id_type)
        ours = embed(emb.weight, emb.scales, emb.biases, tokens, group_size=group_size,
                     bits=bits)
        assert same_bits(ours, emb(tokens))


def test_quantized_embedding_of_an_id_outside_the_table_is_nan_and_bad_input_is_refused():
    embed = native_op("quantized_embedding")
    emb = quantized_embedding(mx.float16, 4, 64, seed=3)
    args = (emb.weight, emb.scales, emb.biases)
    out = embed(*args, mx.array([3, 300, -1], dtype=mx.int32), group_size=64, bits=4)
    assert same_bits(out[0], emb(mx.array([3]))[0])
    assert mx.isnan(out[1:]).all().item()
    ids = mx.array([0, 1], dtype=mx.int32)
    cases = [((*args, ids), {"group_size": 64, "bits": 2}, "bits must be 4 or 8"),
             ((*args, ids), {"group_size": 48, "bits": 4}, "group_size must divide"),
             ((emb.weight, emb.scales, emb.biases[:10], ids), {"group_size": 64, "bits": 4},
              "scales and biases must be"),
             ((emb.weight, emb.scales, emb.biases.astype(mx.float32), ids),
              {"group_size": 64, "bits": 4}, "scales and biases must be"),
             ((*args, ids.astype(mx.float32)), {"group_size": 64, "bits": 4},
              "ids must be int32 or uint32")]
    for positional, keywords, message in cases:
        with pytest.raises(ValueError, match=message):
            embed(*positional, **keywords)


def test_the_runner_embeds_quantized_tables_natively_and_others_by_the_module():
    native_op("quantized_embedding")
    loaded = tiny_model()  # 4-bit, groups of 32: its embedding too
    model = loaded.model
    runner = runner_for(model, "auto")
    module = model.model.embed_tokens
    assert type(module) is nn.QuantizedEmbedding
    tokens = mx.array([5, 0, 77, 5], dtype=mx.int32)
    ours = runner.embed(module, tokens)
    assert "QuantizedEmbeddingRows" in primitive_names(ours)  # before it is evaluated
    assert same_bits(ours, module(tokens[None]))
    assert ours.shape == (1, 4, model.args.hidden_size)
    plain = runner_for(model, "mlx")  # MLX's ops for every row op
    assert plain.embedding_kernel is None
    assert "QuantizedEmbeddingRows" not in primitive_names(plain.embed(module, tokens))
    table = nn.Embedding(128, 8)  # not quantized: the module's own call (ids below 128)
    assert mx.array_equal(runner.embed(table, tokens[:3]), table(tokens[:3][None])).item()


def primitive_names(out: mx.array) -> set[str]:
    """The names of the primitives in the (unevaluated) graph that computes `out`."""
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return set(re.findall(r'label ="([A-Za-z]+)"', dot.getvalue()))
