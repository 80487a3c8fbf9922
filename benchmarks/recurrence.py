"""The Gated DeltaNet recurrence of a step (engine/recurrence.py): MLX ops against the native
kernel (engine/native/gated_delta.cpp), float32, on one layer the size of a ~135M-parameter
hybrid model's (Hk 4, Hv 8, Dk = Dv = 64, conv kernel 4).

Steps: 1 and 8 decode rows (one sequence each) and one 512-row prefill chunk. Each time is
the median of --repeats calls, each evaluated (y and the pools) before the next; the pools
carry over from call to call, as an engine's would. Prints a markdown table; writes no file.

    .venv/bin/python benchmarks/recurrence.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.qwen3_5 import GatedDeltaNet, TextModelArgs

from engine import native
from engine.recurrence import gated_delta_rows

STEPS = [("decode, 1 sequence", [1] * 1), ("decode, 8 sequences", [1] * 8),
         ("prefill, 512 rows", [512])]


def layer() -> GatedDeltaNet:
    mx.random.seed(0)
    args = TextModelArgs(model_type="qwen3_5", hidden_size=576, linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=64,
                         linear_value_head_dim=64, linear_conv_kernel_dim=4)
    gdn = GatedDeltaNet(args)
    mx.eval(gdn.parameters())
    return gdn


def seconds_per_call(gdn, lens: list[int], kernel, repeats: int) -> float:
    rng = np.random.default_rng(0)
    rows = sum(lens)
    qkv = mx.array(rng.standard_normal((rows, gdn.conv_dim)).astype(np.float32))
    a, b = (mx.array(rng.standard_normal((rows, gdn.num_v_heads)).astype(np.float32))
            for _ in range(2))
    slots = len(lens)
    conv = mx.zeros((slots, gdn.conv_kernel_size - 1, gdn.conv_dim))
    state = mx.zeros((slots, gdn.num_v_heads, gdn.head_v_dim, gdn.head_k_dim))
    mx.eval(qkv, a, b, conv, state)
    groups = [(n, i) for i, n in enumerate(lens)]
    times = []
    for _ in range(repeats + 2):  # the first two warm up
        t0 = time.perf_counter()
        y, conv, state = gated_delta_rows(qkv, a, b, gdn, conv, state, groups, [],
                                          kernel=kernel)
        mx.eval(y, conv, state)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    kernel = native.gated_delta_rows()
    if kernel is None:
        print(f"native kernel {native.why_not()}", file=sys.stderr)
        return 1
    gdn = layer()
    print(f"native threads: {native.threads()}\n")
    print("| step | MLX ops | native | native speed-up |")
    print("|---|---|---|---|")
    for name, lens in STEPS:
        repeats = max(3, args.repeats // max(1, sum(lens) // 64))  # fewer for long steps
        ops = seconds_per_call(gdn, lens, None, repeats)
        fast = seconds_per_call(gdn, lens, kernel, repeats)
        print(f"| {name} | {ops * 1e3:.2f} ms | {fast * 1e3:.3f} ms | {ops / fast:.1f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
