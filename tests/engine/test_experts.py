"""Mixture-of-experts pieces without a model folder: the expert kernel paths, the adapter's
expert call against mlx-lm's SwitchGLU, dequantized expert weights, and the refusals.

The batch-invariance finding in engine/kernels.py (above apply_experts) rests on
test_a_rows_experts_get_the_same_bits_alone_and_among_others.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import mixtral, qwen3_moe
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

from engine.kernels import EXPERT_SORT_AT, apply_experts, expert_tile
from engine.models import UnsupportedModelError, family_for
from engine.models.moe import swiglu_experts
from engine.platform import backend_info
from engine.weights.dequantize import dequantize_to
from engine.weights.formats import describe_weights, has_experts

HIDDEN, INTER = 64, 128


def _switch(num_experts: int, quantize: bool, seed: int = 0, bias: bool = False) -> SwitchGLU:
    mx.random.seed(seed)
    switch = SwitchGLU(HIDDEN, INTER, num_experts, bias=bias)
    # Scaled and biased so every product matters (mlx-lm initialises biases to zero).
    switch.update(tree_unflatten([(n, p * 3 if p.ndim == 3 else mx.random.normal(p.shape))
                                  for n, p in tree_flatten(switch.parameters())]))
    if quantize:
        nn.quantize(switch, group_size=64, bits=4)
    mx.eval(switch.parameters())
    return switch


def _choice(rows: int, num_experts: int, k: int, seed: int = 1) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    x = mx.random.normal((1, rows, HIDDEN))
    logits = mx.random.normal((1, rows, num_experts))
    return x, mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]


def _alone_vs_together(switch, x, indices, path, tile=16) -> list[int]:
    """The rows whose expert output differs between the whole call and the row alone."""
    together = np.array(apply_experts(switch, x, indices, path, tile))
    assert together.shape == (*indices.shape, HIDDEN)
    return [r for r in range(x.shape[1])
            if not np.array_equal(np.array(apply_experts(switch, x[:, r:r + 1],
                                                         indices[:, r:r + 1], path, tile))[0, 0],
                                  together[0, r])]


# 5 rows x top-2: 10 choices, never sorted; 40 x 2 = 80 and 16 x 8 = 128: a gathered call of
# them all is sorted by mlx-lm (EXPERT_SORT_AT), and a 16-row tile of top-8 would be.
CASES = [(8, 2, 5), (8, 2, 40), (16, 8, 16)]


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q4"])
@pytest.mark.parametrize("path", ["gemm", "gemv", "tiled"])
@pytest.mark.parametrize("num_experts,k,rows", CASES)
def test_a_rows_experts_get_the_same_bits_alone_and_among_others(quantize, path, num_experts,
                                                                 k, rows):
    """gather_qmm (4-bit) gives a row the same bits in any call; gather_mm (float32) in any
    call on the same side of the sort threshold, which the tiled path never crosses."""
    if path == "gemm" and not quantize and rows * k >= EXPERT_SORT_AT and backend_info()["blas"]:
        pytest.skip("sorted float32 gemm: see test_float32_gemm_crosses_the_sort_threshold")
    x, indices = _choice(rows, num_experts, k)
    experts = swiglu_experts(_switch(num_experts, quantize))
    assert _alone_vs_together(experts, x, indices, path) == []


def test_float32_gemm_crosses_the_sort_threshold():
    """The finding behind engine/kernels.py's note: with OpenBLAS a float32 row's experts get
    other bits in a sorted call (>= EXPERT_SORT_AT choices) than in an unsorted one, and the
    same bits in every call on one side."""
    if not backend_info()["blas"]:
        pytest.skip("MLX's bundled BLAS gives both layouts the same bits")
    switch = swiglu_experts(_switch(8, False))
    x, indices = _choice(100, 8, 2)
    bits = {n: np.array(apply_experts(switch, x[:, :n], indices[:, :n], "gemm"))[0, 0]
            for n in (1, 31, 32, 100)}  # 2, 62 choices: unsorted; 64, 200: sorted
    assert np.array_equal(bits[1], bits[31]) and np.array_equal(bits[32], bits[100])
    if np.array_equal(bits[31], bits[32]):
        # Seen on an Intel AVX-512 machine: OpenBLAS's kernel for it sums both layouts alike.
        pytest.skip(f"this CPU's OpenBLAS kernel ({backend_info()['blas']}) gives sorted and "
                    "unsorted calls the same bits")
    assert _alone_vs_together(switch, x[:, :40], indices[:, :40], "gemm") == list(range(40))
    # A 16-row tile of top-8 choices (128) would be sorted: the tiled path splits it.
    switch, (x, indices) = swiglu_experts(_switch(16, False)), _choice(16, 16, 8)
    assert _alone_vs_together(switch, x, indices, "gemm") == list(range(16))
    assert _alone_vs_together(switch, x, indices, "tiled") == []


def test_expert_tiles_stay_under_the_sort_threshold():
    assert [expert_tile(16, k) for k in (1, 2, 4, 8, 64)] == [16, 16, 15, 7, 1]


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q4"])
@pytest.mark.parametrize("path", ["gemv", "tiled"])
def test_every_path_equals_mlx_lms_gathered_call(quantize, path):
    switch = _switch(8, quantize)
    x, indices = _choice(7, 8, 2)  # 7 rows: the tiled path pads to 8, padding on expert 0
    expected = np.array(switch(x, indices))
    assert np.array_equal(np.array(apply_experts(swiglu_experts(switch), x, indices, path, 4)),
                          expected)


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q4"])
@pytest.mark.parametrize("rows", [3, 40])  # below and above mlx-lm's sort threshold
def test_uncompiled_experts_give_mlx_lms_bits(quantize, rows):
    switch = _switch(8, quantize, bias=True)
    x, indices = _choice(rows, 8, 2)
    ours = swiglu_experts(switch)(x, indices)
    assert np.array_equal(np.array(ours), np.array(switch(x, indices)))


def test_experts_other_than_switchglu_swiglu_are_refused():
    switch = _switch(4, False)
    switch.activation = nn.GELU()
    with pytest.raises(UnsupportedModelError, match="SwiGLU"):
        swiglu_experts(switch)


@pytest.mark.parametrize("bias", [False, True])
def test_dequantized_experts_are_dense_switch_layers(bias):
    model = nn.Sequential(_switch(4, quantize=True, bias=bias))
    quantized = model.layers[0].up_proj
    assert isinstance(quantized, QuantizedSwitchLinear) and describe_weights(model) == "q4"
    expected = mx.dequantize(quantized.weight, quantized.scales, quantized.biases,
                             group_size=64, bits=4)
    x, indices = _choice(6, 4, 2)
    q_out = model.layers[0](x, indices)
    model = dequantize_to(model, mx.float32)
    dense = model.layers[0].up_proj
    assert type(dense) is SwitchLinear and dense.weight.shape == (4, INTER, HIDDEN)
    assert np.array_equal(np.array(dense.weight), np.array(expected))
    assert ("bias" in dense) == bias
    assert describe_weights(model) == "f32" and has_experts(model)
    # The same products as gather_qmm's, up to float32 rounding.
    assert mx.allclose(model.layers[0](x, indices), q_out, atol=1e-3).item()


TINY = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 256}


def _qwen3_moe(**overrides):
    config = {**TINY, "model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [1],
              "moe_intermediate_size": 64, "norm_topk_prob": True, **overrides}
    return qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config)), config


def test_qwen3_moe_expert_layers_skip_its_dense_layers():
    model, config = _qwen3_moe(decoder_sparse_step=1, mlp_only_layers=[1])
    family = family_for(model, config)
    assert family.expert_layers() == {0: 8, 2: 8}
    assert family.describe_layers() == ["2 of 3 layers route each token to 2 of 8 experts"]
    model, config = _qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[])
    assert family_for(model, config).expert_layers() == {1: 8}


def test_mixtral_routes_every_layer():
    config = {**TINY, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    model = mixtral.Model(mixtral.ModelArgs.from_dict(config))
    family = family_for(model, config)
    assert family.expert_layers() == {0: 4, 1: 4, 2: 4}
    assert [(kv.kv_heads, kv.head_dim) for kv in family.layer_kv()] == [(2, 16)] * 3


def test_dense_bf16_experts_are_refused_on_the_cpu():
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU backend's gather_mm limit")
    model, config = _qwen3_moe()
    model.set_dtype(mx.bfloat16)
    with pytest.raises(UnsupportedModelError, match="float32 only"):
        family_for(model, config)
    nn.quantize(model, group_size=64, bits=4)  # quantized experts run in any dtype
    assert family_for(model, config).expert_layers() == {0: 8, 2: 8}
