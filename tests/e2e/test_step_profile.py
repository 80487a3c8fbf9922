"""benchmarks/step_profile.py's kernel-alone measurement: it times the layers the fused
decoder layer calls (q/k/v and gate/up stacked) and the head, and refuses a model whose
layers the quantized kernel does not take; its in-cache rate times one layer over and over;
and it counts the ops a step's graph queues."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from native_ops import decode_groups, native_op, runner_for

from engine.testing import tiny_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import step_profile  # noqa: E402


def test_the_kernel_alone_times_the_fused_layers_stacked_linears_and_the_head():
    native_op("decoder_layers")
    loaded = tiny_model()
    runner = runner_for(loaded.model)
    linears, head = step_profile.kernel_layers(runner, loaded.model)
    blocks = loaded.model.model.layers
    assert len(linears) == 4 * len(blocks)
    attention, mlp = blocks[0].self_attn, blocks[0].mlp
    outputs = [lin.weight.shape[0] for lin in linears[:4]]
    assert outputs == [attention.q_proj.weight.shape[0] + 2 * attention.k_proj.weight.shape[0],
                       attention.o_proj.weight.shape[0], 2 * mlp.gate_proj.weight.shape[0],
                       mlp.down_proj.weight.shape[0]]
    assert head.weight.shape[0] == loaded.config["vocab_size"]
    every = [*linears, head]
    assert step_profile.layer_bytes(every) == sum(
        a.nbytes for lin in every for a in (lin.weight, lin.scales, lin.biases))
    times = step_profile.kernel_alone((linears, head), rows=2, rounds=2)
    assert set(times) == {"linear layers, kernel alone", "head, kernel alone"}
    assert all(ms > 0 for ms in times.values())


def test_a_float32_model_has_no_quantized_layers_to_time():
    native_op("decoder_layers")
    loaded = tiny_model(quantize=False)
    assert step_profile.kernel_layers(runner_for(loaded.model), loaded.model) is None


def test_with_int8_activations_the_kernel_alone_times_the_int8_option(monkeypatch):
    native_op("decoder_layers")
    from engine import native

    loaded = tiny_model()
    runner = step_profile.decode_runner(loaded, 64, activations="int8")
    layers = step_profile.kernel_layers(runner, loaded.model)
    read_bandwidth, time_quantized_linears = native.kernel_timing()
    asked = []

    def recorded(*args, **kwargs):
        asked.append(kwargs["int8_activations"])
        return time_quantized_linears(*args, **kwargs)

    monkeypatch.setattr(native, "kernel_timing", lambda: (read_bandwidth, recorded))
    step_profile.kernel_alone(layers, rows=1, rounds=1)
    assert asked == [True]
    step_profile.kernel_alone(step_profile.kernel_layers(runner_for(loaded.model), loaded.model),
                              rows=1, rounds=1)
    assert asked == [True, False]


def test_the_in_cache_rate_times_the_first_layer_once_per_linear_layer(monkeypatch):
    native_op("decoder_layers")
    from engine import native

    loaded = tiny_model()
    layers = step_profile.kernel_layers(runner_for(loaded.model), loaded.model)
    linears = layers[0]
    read_bandwidth, time_quantized_linears = native.kernel_timing()
    asked = []

    def recorded(ws, scales, biases, bits, group_sizes, **kwargs):
        asked.append((ws, kwargs["rows"]))
        return time_quantized_linears(ws, scales, biases, bits, group_sizes, **kwargs)

    monkeypatch.setattr(native, "kernel_timing", lambda: (read_bandwidth, recorded))
    rate = step_profile.kernel_in_cache(layers, rounds=2)
    (ws, rows), = asked
    assert rows == 1 and len(ws) == len(linears)
    assert all(w is linears[0].weight for w in ws)
    assert rate > 0


def test_graph_ops_counts_the_primitives_a_graph_queues():
    a = mx.array([1.0, 2.0])
    mx.eval(a)
    assert step_profile.graph_ops(a) == 0  # evaluated: nothing to queue
    assert step_profile.graph_ops(mx.exp(a) * a) == 2
    assert step_profile.graph_ops(mx.exp(a), mx.exp(a) * a) == 3  # two exps, one multiply


def test_a_one_row_decode_step_queues_fewer_ops_on_the_native_row_kernels(monkeypatch):
    """The graph a one-row decode step queues (mx.async_eval's arrays, as profile() counts
    them): the native row kernels (the embedding, the fused layers, the greedy choice) take
    fewer ops than MLX's own."""
    native_op("decoder_layers")
    loaded = tiny_model()
    real_async_eval = mx.async_eval
    queued = []

    def counted(*arrays):
        queued.append(step_profile.graph_ops(*arrays))
        real_async_eval(*arrays)

    counts = {}
    for setting in ("auto", "mlx"):
        runner = runner_for(loaded.model, setting)
        prefill, decode = decode_groups([20])
        runner.run(prefill)
        queued.clear()
        monkeypatch.setattr(mx, "async_eval", counted)
        runner.run(decode)
        monkeypatch.setattr(mx, "async_eval", real_async_eval)
        counts[setting] = queued[0]
    assert 0 < counts["auto"] < counts["mlx"] / 2, counts
