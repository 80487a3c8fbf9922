"""The fused llama-style decoder layer (engine/native/decoder_layer.cpp): the bits of the layer
computed op by op, on every family that uses it, each weight format and pool dtype; where it
applies and where the step keeps the op-by-op layer; bad input refused."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from native_ops import native_op

from engine.model_loader import load_model
from engine.model_runner import ModelRunner, pool_for
from engine.models import family_for
from engine.sampling import SamplingParams
from engine.scheduler import RowGroup
from engine.testing import FAMILY_CONFIGS, make_family_folder

FAMILIES = ["llama", "llama-sliding", "qwen2", "qwen3", "smollm3"]


class Folders:
    """Tiny folders of the families the op computes, made on first use: folders[name][weights]
    is the loaded model."""

    def __init__(self, root):
        self.root, self.made = root, {}

    def __getitem__(self, name):
        if name not in self.made:
            module_name, config = FAMILY_CONFIGS[name]
            module = importlib.import_module(f"mlx_lm.models.{module_name}")
            path = self.root / name
            self.made[name] = {
                "f32": load_model(str(make_family_folder(path / "f32", module, config)), "f32"),
                "q4": load_model(str(make_family_folder(path / "q4", module, config,
                                                        quantize=True)), "q4")}
        return self.made[name]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    native_op("decoder_layers")
    return Folders(tmp_path_factory.mktemp("families"))


def steps(lens=(37, 5, 20)):
    """A prefill step of several sequences, a mixed step (one sequence's second chunk beside
    the others' decode rows), then two decode steps."""
    prefill, mixed, decode, block = [], [], [], 0
    for i, n in enumerate(lens):
        table = list(range(block, block + -(-(n + 12) // 16)))
        block += len(table)
        tokens = [(11 * j + 3 * i) % 300 + 5 for j in range(n + 12)]
        if i == 0:  # its prompt in two chunks: the second shares a step with decode rows
            prefill.append(RowGroup(f"s{i}", tokens[:n - 9], 0, table, False))
            mixed.append(RowGroup(f"s{i}", tokens[n - 9:n], n - 9, table, True,
                                  SamplingParams()))
        else:
            prefill.append(RowGroup(f"s{i}", tokens[:n], 0, table, True, SamplingParams()))
            mixed.append(RowGroup(f"s{i}", tokens[n:n + 1], n, table, True, SamplingParams()))
        decode.append([RowGroup(f"s{i}", tokens[n + 1 + k:n + 2 + k], n + 1 + k, table, True,
                                SamplingParams()) for k in range(2)])
    return [prefill, mixed, [d[0] for d in decode], [d[1] for d in decode]]


class Counting:
    """The fused op (native.decoder_layers), counting the layers it took and its calls (so a
    test knows the op ran, and on how many layers)."""

    def __init__(self, op):
        self.op, self.layers, self.calls = op, 0, 0

    def __call__(self, x, specs, *args):
        self.layers += len(specs)
        self.calls += 1
        return self.op(x, specs, *args)


def run_steps(loaded, fused: bool, kv_dtype=None, path: str = "gemm", counted: str = "layers"):
    family = family_for(loaded.model)
    runner = ModelRunner(loaded.model, pool_for(family, 64, 16, kv_dtype), "auto", "auto",
                         family)
    counting = Counting(runner.layer_kernel)
    runner.layer_kernel = counting if fused else None
    samples = [runner.run(groups, path).samples for groups in steps()]
    pool = [np.array(a.astype(mx.float32)) for a in runner.pool.state()]
    return samples, pool, getattr(counting, counted)


# llama and qwen3 (q/k norms) in every tier; the other families in `make test` (slow).
FAMILY_CASES = [pytest.param(name, marks=() if name in ("llama", "qwen3") else pytest.mark.slow)
                for name in FAMILIES]


@pytest.mark.parametrize("weights", ["f32", "q4"])
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_fused_layer_has_the_bits_of_the_layer_op_by_op(folders, name, weights):
    loaded = folders[name][weights]
    fused, fused_pool, calls = run_steps(loaded, True)
    plain, plain_pool, _ = run_steps(loaded, False)
    layers = len(family_for(loaded.model).layers)
    # f32 layers take the native kernel on steps of up to 32 rows only: the 62-row prefill
    # step is op by op there, the others fused.
    assert calls == layers * (3 if weights == "f32" else 4)
    assert fused == plain  # tokens and logprobs, every row of every step
    for a, b in zip(fused_pool, plain_pool, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("name, ops_per_step", [
    ("llama", 1), pytest.param("llama-sliding", 2, marks=pytest.mark.slow)])
def test_a_step_takes_its_fused_layers_as_one_op_per_window(folders, name, ops_per_step):
    """Consecutive layers that share a window go as one op (llama-sliding: two sliding layers,
    then a full one), so a step schedules one op where it had one per layer."""
    loaded = folders[name]["q4"]
    _, _, ops = run_steps(loaded, True, counted="calls")
    assert ops == 4 * ops_per_step  # every step of steps() fused


def test_layers_the_op_cannot_take_together_are_refused(folders):
    loaded = folders["llama-sliding"]["q4"]
    family = family_for(loaded.model)
    runner = ModelRunner(loaded.model, pool_for(family, 4, 16), "auto", "auto", family)
    sliding, full = runner.fused_layer_of(0).spec, runner.fused_layer_of(2).spec
    k0, v0 = runner.pool.writable(0, mx.float32)
    k2, v2 = runner.pool.writable(runner.layer_kv[2].pool_layer, mx.float32)
    x = mx.random.normal((1, sliding.qkv.weight.shape[1] * 32 // sliding.qkv.bits))
    one = [mx.array(a, dtype=mx.int32) for a in ([3], [3], [[0]], [4], [1])]
    with pytest.raises(ValueError, match="share the pool's slots, the block size and the window"):
        runner.layer_kernel(x, [sliding, full], [k0, k2], [v0, v2], *one)
    with pytest.raises(ValueError, match="one k_pool and one v_pool for each"):
        runner.layer_kernel(x, [sliding, sliding], [k0], [v0], *one)


@pytest.mark.parametrize("half", [mx.float16, mx.bfloat16])
def test_fused_layer_widens_a_half_precision_embedding_as_the_op_by_op_layer(folders, half):
    """A quantized embedding with half-precision scales (as a GGUF's are) hands the first layer
    a half x: the fused op takes it too, widened, with the op-by-op layer's bits."""
    loaded = folders["qwen3"]["q4"]
    family = family_for(loaded.model)
    embed = family.inner.embed_tokens
    scales, biases = embed.scales, embed.biases
    embed.scales, embed.biases = scales.astype(half), biases.astype(half)
    try:
        assert embed(mx.array([[5, 6]])).dtype == half
        fused, fused_pool, calls = run_steps(loaded, True)
        plain, plain_pool, _ = run_steps(loaded, False)
    finally:
        embed.scales, embed.biases = scales, biases
    assert calls == len(family.layers) * 4  # the first layer included, on every step
    assert fused == plain
    for a, b in zip(fused_pool, plain_pool, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kv_dtype", [mx.float16, mx.bfloat16])
def test_fused_layer_writes_a_narrower_pool_as_the_op_by_op_layer(folders, kv_dtype):
    loaded = folders["qwen3"]["q4"]
    fused, fused_pool, calls = run_steps(loaded, True, kv_dtype)
    plain, plain_pool, _ = run_steps(loaded, False, kv_dtype)
    assert calls > 0 and fused == plain
    for a, b in zip(fused_pool, plain_pool, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("weights", ["f32", "q4"])
def test_the_batch_invariant_path_takes_the_fused_layer_with_its_bits(folders, weights):
    """--batch-invariant ("tiled") runs the fused layer where "gemm" does: every part of it is
    a native op there too. Above the float32 row limit the layer is op by op on the native
    kernels, so 4-bit steps have the bits of "gemm" steps."""
    loaded = folders["llama"][weights]
    fused, fused_pool, calls = run_steps(loaded, True, path="tiled")
    plain, plain_pool, _ = run_steps(loaded, False, path="tiled")
    assert calls == len(family_for(loaded.model).layers) * (3 if weights == "f32" else 4)
    assert fused == plain
    for a, b in zip(fused_pool, plain_pool, strict=True):
        assert np.array_equal(a, b)
    if weights == "q4":
        assert fused == run_steps(loaded, True)[0]


def test_the_row_wise_path_keeps_the_layer_op_by_op(folders):
    loaded = folders["llama"]["q4"]
    _, _, calls = run_steps(loaded, True, path="gemv")
    assert calls == 0
    family = family_for(loaded.model)
    runner = ModelRunner(loaded.model, pool_for(family, 64, 16), "auto", "mlx", family)
    assert runner.layer_kernel is None  # --row-kernels mlx: MLX's own ops throughout


def bad_call(loaded, **change):
    """The op on a one-row step of layer 0 with one step input changed; returns (out, pool
    before, pools)."""
    family = family_for(loaded.model)
    runner = ModelRunner(loaded.model, pool_for(family, 4, 16), "auto", "auto", family)
    layer = family.layers[0]
    spec = runner.fused_layer_of(0).spec
    k_pool, v_pool = runner.pool.writable(0, mx.float32)
    args = dict(slots=mx.array([3], dtype=mx.int32), positions=mx.array([3], dtype=mx.int32),
                tables=mx.array([[0]], dtype=mx.int32), lens=mx.array([4], dtype=mx.int32),
                qlens=mx.array([1], dtype=mx.int32))
    args.update(change)
    x = mx.random.normal((1, layer.input_layernorm.weight.shape[0]))
    before = [np.array(k_pool), np.array(v_pool)]
    out = runner.layer_kernel(x, [spec], [k_pool], [v_pool], args["slots"], args["positions"],
                              args["tables"], args["lens"], args["qlens"])
    return out, before, (k_pool, v_pool)


def test_bad_tables_are_refused_before_the_pool_is_written(folders):
    loaded = folders["llama"]["q4"]
    for change, message in [(dict(tables=mx.array([[7]], dtype=mx.int32)), "block id"),
                            (dict(slots=mx.array([64], dtype=mx.int32)), "write slot"),
                            (dict(lens=mx.array([40], dtype=mx.int32)), "context length")]:
        out, before, pools = bad_call(loaded, **change)
        with pytest.raises(RuntimeError, match=message):
            mx.eval(out)
        for a, b in zip(before, pools, strict=True):
            assert np.array_equal(a, np.array(b))  # untouched


def test_bad_shapes_are_refused_when_the_op_is_built(folders):
    loaded = folders["llama"]["q4"]
    with pytest.raises(ValueError, match="slots and positions must be"):
        bad_call(loaded, slots=mx.array([3, 4], dtype=mx.int32))
    with pytest.raises(ValueError, match="block_tables must be"):
        bad_call(loaded, lens=mx.array([4, 4], dtype=mx.int32))


SPEC_FIELDS = ("attn_norm", "mlp_norm", "norm_eps", "qkv", "o", "gate_up", "down", "q_bias",
               "k_bias", "v_bias", "q_norm", "k_norm", "qk_norm_eps", "heads", "kv_heads",
               "head_dim", "rope", "attn_scale", "block_size", "window")


def test_a_spec_with_a_wrong_field_is_refused_naming_the_field(folders):
    loaded = folders["qwen3"]["q4"]  # quantized linears, q/k norms and RoPE
    family = family_for(loaded.model)
    runner = ModelRunner(loaded.model, pool_for(family, 4, 16), "auto", "auto", family)
    spec = runner.fused_layer_of(0).spec
    layer_spec = type(spec)
    fields = {name: getattr(spec, name) for name in SPEC_FIELDS}
    layer_spec(**fields)  # the fields as the runner named them are taken
    qkv, rope = fields["qkv"], fields["rope"]
    for change, message in [
        (dict(qkv=layer_spec.Linear(qkv.weight, scales=qkv.scales, biases=qkv.biases, bits=3,
                                    group_size=qkv.group_size)), r"qkv: bits must be 0"),
        (dict(o=fields["gate_up"]), r"o: weight \(\d+, \d+\) does not hold"),
        (dict(o=layer_spec.Linear(mx.zeros((fields["attn_norm"].shape[0],
                                            fields["heads"] * fields["head_dim"])))),
         r"o: weight \(\d+, \d+\) must be float32 packed by pack_linear_weight"),
        (dict(down=layer_spec.Linear(qkv.weight, scales=qkv.scales, bits=4,
                                     group_size=qkv.group_size)), r"down: .* scales and biases"),
        (dict(mlp_norm=fields["q_norm"]), r"mlp_norm must be float32"),
        (dict(k_norm=None), r"q_norm and k_norm: both or neither"),
        (dict(v_bias=fields["q_norm"]), r"q_bias, k_bias and v_bias"),
        (dict(rope=layer_spec.Rope(inv_freqs=rope.inv_freqs, dims=rope.dims + 1,
                                   traditional=rope.traditional, scale=rope.scale)),
         r"rope\.dims must be even"),
        (dict(kv_heads=fields["heads"] + 1), r"heads must be a positive multiple of kv_heads"),
        (dict(block_size=0), r"block_size must be positive"),
    ]:
        with pytest.raises(ValueError, match=r"^decoder_layer: " + message):
            layer_spec(**(fields | change))
