"""The native measurements behind benchmarks/step_profile.py (engine/native/kernel_timing.h):
the memory the native threads read, and the quantized kernel timed on its own."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from native_ops import native_op, random


def timing():
    native_op("decode_quantized_linear")  # skips (fails on CI) where nothing is built
    from engine import native

    return native.kernel_timing()


def layer(out, k, bits, group_size=32, seed=0):
    w, scales, biases = mx.quantize(mx.array(random((out, k), seed)).astype(mx.float16),
                                    group_size=group_size, bits=bits)
    mx.eval(w, scales, biases)
    return w, scales, biases


def test_read_bandwidth_is_a_rate_and_refuses_a_size_it_cannot_read():
    read_bandwidth, _ = timing()
    rate = read_bandwidth(8 * 2**20, 2)
    assert math.isfinite(rate) and rate > 0
    for size in (0, 4095, 8192 + 1):
        with pytest.raises(ValueError, match="multiple of 4096"):
            read_bandwidth(size, 1)
    with pytest.raises(ValueError, match="rounds"):
        read_bandwidth(4096, 0)


def test_each_round_times_each_layer_in_turn():
    _, time_quantized_linears = timing()
    layers = [layer(64, 128, 4), layer(96, 64, 8, group_size=64, seed=1)]
    times = time_quantized_linears([w for w, _, _ in layers], [s for _, s, _ in layers],
                                   [b for _, _, b in layers], [4, 8], [32, 64], rows=3,
                                   rounds=4)
    assert len(times) == 4
    assert all(len(t) == 2 and all(math.isfinite(x) and x > 0 for x in t) for t in times)
    int8 = time_quantized_linears([w for w, _, _ in layers], [s for _, s, _ in layers],
                                  [b for _, _, b in layers], [4, 8], [32, 64], rows=3,
                                  rounds=2, int8_activations=True)
    assert len(int8) == 2 and all(len(t) == 2 and min(t) > 0 for t in int8)


def test_refuses_layers_it_cannot_time():
    _, time_quantized_linears = timing()
    w, s, b = layer(64, 128, 4)

    def timed(ws=(w,), scales=(s,), biases=(b,), bits=(4,), groups=(32,)):
        return time_quantized_linears(list(ws), list(scales), list(biases), list(bits),
                                      list(groups), rows=1, rounds=1)

    with pytest.raises(ValueError, match="one entry per layer"):
        timed(bits=(4, 4))
    with pytest.raises(ValueError, match="no layers"):
        timed(ws=(), scales=(), biases=(), bits=(), groups=())
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        timed(bits=(3,))
    with pytest.raises(ValueError, match="group_size"):
        timed(groups=(16,))
    narrow, transposed = mx.zeros((64, 2), dtype=s.dtype), mx.zeros((4, 64), dtype=s.dtype).T
    mx.eval(narrow, transposed)
    for bad in (narrow, transposed):  # (out, 2): not in / group_size; the right shape, strided
        with pytest.raises(ValueError, match="scales and biases must be row-contiguous"):
            timed(scales=(bad,))
    with pytest.raises(ValueError, match="biases must have the scales' dtype"):
        biases32 = b.astype(mx.float32)
        mx.eval(biases32)
        timed(biases=(biases32,))
    with pytest.raises(ValueError, match="evaluate the arrays first"):
        timed(ws=(w + 0,))  # a lazy array: its data is not there yet
