"""The forward's all_sums under tensor parallelism (engine/distributed/), and their time.

Every all_sum of a sharded forward goes through `all_sum`: the row-sharded linears
(engine/native_ops.py) and the routed blocks' sums of their experts (engine/models/experts.py).
With timing on (each rank of a tensor-parallel engine), it evaluates its input first and its
result at once, and adds the seconds in between to this process's count, which each step takes
with `take_seconds`: the time the rank spent in the collectives and waiting for its peers
there, apart from the forward's own compute. The evaluations cut the step's graph at each
all_sum, which makes the step slower (benchmarks/plan_broadcast.py measures both ways;
docs/distributed.md has the numbers): so it is off unless asked for (--time-collectives).
"""

from __future__ import annotations

import time

import mlx.core as mx

_timing = False
_seconds = 0.0


def set_timing(on: bool) -> None:
    """Time this process's all_sums from now on (or stop), starting from zero."""
    global _timing, _seconds
    _timing, _seconds = on, 0.0


def all_sum(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """mx.distributed.all_sum over `group`, timed when timing is on."""
    global _seconds
    if not _timing:
        return mx.distributed.all_sum(x, group=group)
    mx.eval(x)
    start = time.perf_counter()
    out = mx.distributed.all_sum(x, group=group)
    mx.eval(out)
    _seconds += time.perf_counter() - start
    return out


def take_seconds() -> float | None:
    """Seconds in timed all_sums since the last call (or set_timing), and start again; None
    while timing is off."""
    global _seconds
    seconds, _seconds = _seconds, 0.0
    return seconds if _timing else None
