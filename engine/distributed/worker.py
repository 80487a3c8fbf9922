"""The ranks' step loop: rank 0 encodes and broadcasts each step's plan, then every rank runs
the same ModelRunner step on its shard; ranks > 0 loop on received plans until a stop plan.

Each step ends with one fixed-size all_gather of every rank's times (seconds: in the plan
broadcast, the step's wall time after it, the forward + sampling, the forward's all_sums), so
rank 0 learns what the collectives cost (StepTimes; engine/collectives.py times the
all_sums). A rank that is lost turns rank 0's next collective into an
error, raised as DistributedError naming the ranks that exited.

Run as `python -m engine.distributed.worker --model FOLDER ... --rank R --hostfile H`: one
rank > 0 (start_ranks adds those, the run folder and the doorbell).
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine import collectives
from engine.config import DEFAULT_TILE, KernelPath, NativeSetting
from engine.distributed.launch import DEFAULT_START_TIMEOUT, DistributedError, RankProcesses, join
from engine.distributed.plan import broadcast, decode, encode, encode_sleep, encode_stop
from engine.distributed.shard import shard_model
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner, StepOutput, pool_for
from engine.models import family_for
from engine.scheduler import RowGroup

_TIMES = 4  # per rank: broadcast, wall after it, model time, the forward's all_sums
# Seconds without a step after which rank 0 puts the other ranks to sleep: longer than the
# gaps between a busy server's steps, so their latency stays the ring's.
IDLE_S = 0.1
# Ranks without a doorbell (mlx.launch's, on other machines maybe) sleep this long a time,
# then join a broadcast: rank 0 sends one sleep plan a nap while idle, and the first step
# after a pause waits for the next of those meetings (at most a nap).
NAP_MS = 20


@dataclass
class StepTimes:
    """What one step's collectives cost, per rank (index = rank), in seconds."""

    broadcast_s: list[float]  # in the plan broadcast (ranks > 0: includes waiting for it)
    wall_s: list[float]  # the step after the broadcast: forward, sampling, its all_sums
    model_s: list[float]  # StepOutput.model_time
    all_sum_s: list[float]  # in the forward's all_sums, peers' waits included (NaN: untimed)
    gather_s: float  # rank 0's time in this all_gather of the times


def sharded_runner(loaded: LoadedModel, group: mx.distributed.Group, num_blocks: int,
                   block_size: int, kv_dtype: str = "auto", time_collectives: bool = False,
                   **runner_args) -> ModelRunner:
    """`loaded` sharded over `group` (engine/distributed/shard.py) and its runner over a
    paged pool of the local kv heads (kv_dtype: EngineConfig's); every rank calls it with the
    same arguments. time_collectives: each step reports its all_sums' time (all_sum_s), at
    the cost of cutting the step's graph there (engine/collectives.py)."""
    collectives.set_timing(time_collectives)
    shard_model(loaded.model, group, loaded.config)
    family = family_for(loaded.model, loaded.config)
    return ModelRunner(loaded.model, pool_for(family, num_blocks, block_size,
                                              pool_dtype(kv_dtype)),
                       family=family, **runner_args)


def pool_dtype(kv_dtype: str) -> mx.Dtype | None:
    """EngineConfig.kv_dtype as pool_for takes it (None: the model's)."""
    return None if kv_dtype == "auto" else getattr(mx, kv_dtype)


def _gather_times(group: mx.distributed.Group, broadcast_s: float, wall_s: float,
                  out: StepOutput) -> np.ndarray:
    """Every rank's times of the step just run (rows: ranks; columns: StepTimes' lists), this
    rank's given; an untimed all_sum time (engine/collectives.py) travels as NaN."""
    all_sum_s = collectives.take_seconds()
    mine = [broadcast_s, wall_s, out.model_time, math.nan if all_sum_s is None else all_sum_s]
    times = mx.distributed.all_gather(mx.array(mine, dtype=mx.float32), group=group,
                                      stream=mx.cpu)
    return np.array(times).reshape(group.size(), _TIMES)


class Coordinator:
    """Rank 0's side: each step's plan out to every rank, then the step here.

    MLX's ring backend does not reliably fail a collective whose peer is gone: after its first
    errors a later one can wait forever (it releases the interpreter lock meanwhile). So the
    steps run on a thread of their own, and the caller waits while watching the children: a
    child that exits, or (`step_timeout`) a step that does not finish, raises DistributedError
    naming why, and the coordinator refuses every later step (its thread may be stuck)."""

    def __init__(self, group: mx.distributed.Group, runner: ModelRunner,
                 ranks: RankProcesses | None = None, step_timeout: float | None = None):
        """ranks: the children start_ranks started (None: started by mlx.launch)."""
        if group.rank() != 0:
            raise ValueError(f"the coordinator is rank 0, this is rank {group.rank()}")
        self.group, self.runner, self.ranks = group, runner, ranks
        self.step_timeout = step_timeout
        # A daemon thread: one stuck in a collective must not keep the process from exiting.
        self._calls: queue.Queue = queue.Queue()
        self._broken: str | None = None
        self._asleep = False  # the other ranks sleep (on their doorbells, or a nap)
        self._meet_at = 0.0  # napping ranks join the next broadcast then (time.monotonic)
        threading.Thread(target=self._serve, name="rank0-step", daemon=True).start()

    def step(self, groups: list[RowGroup],
             path: str = KernelPath.GEMM) -> tuple[StepOutput, StepTimes]:
        plan = encode(groups, path)
        return self._wait(self._submit(self._step, plan, groups, path))

    def _submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while True:
            # Ranks with doorbells sleep once a pause; napping ones meet rank 0 every nap.
            if not self._asleep:
                wait = IDLE_S
            elif self.ranks is not None:
                wait = None
            else:
                wait = max(0.0, self._meet_at - time.monotonic())
            try:
                future, fn, args = self._calls.get(timeout=wait)
            except queue.Empty:
                self._sleep()
                continue
            if fn is None:
                return
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)

    def _broadcast(self, plan) -> None:
        if self._asleep:
            if self.ranks is not None:  # wake the children, blocked on their doorbells
                self.ranks.ring()
            else:  # napping ranks join the broadcast at the meeting time
                time.sleep(max(0.0, self._meet_at - time.monotonic()))
            self._asleep = False
        broadcast(self.group, plan)

    def _sleep(self) -> None:
        """No step for IDLE_S: the other ranks sleep, not wait in the next broadcast, whose
        ring sockets busy-poll (a core per rank while the server idles). Children with a
        doorbell block on it; ranks without one (mlx.launch's) nap NAP_MS, and meet rank 0
        in a broadcast after each nap until a step comes."""
        nap = 0 if self.ranks is not None else NAP_MS
        try:
            self._broadcast(encode_sleep(nap))
        except RuntimeError:  # a lost rank: the next step's wait names it
            pass
        self._asleep = True
        self._meet_at = time.monotonic() + nap / 1000

    def _step(self, plan, groups, path) -> tuple[StepOutput, StepTimes]:
        t0 = time.perf_counter()
        self._broadcast(plan)
        t1 = time.perf_counter()
        out = self.runner.run(groups, path)
        t2 = time.perf_counter()
        times = _gather_times(self.group, t1 - t0, t2 - t1, out)
        gather = time.perf_counter() - t2
        return out, StepTimes(*(times[:, i].tolist() for i in range(_TIMES)), gather)

    def _wait(self, future: Future):
        if self._broken is not None:
            raise DistributedError(f"the ranks stopped: {self._broken}")
        start = time.monotonic()
        while True:
            try:
                return future.result(timeout=0.05)
            except FutureTimeout:
                pass
            except RuntimeError as e:  # a collective failed, or the step itself
                lost = self._lost(str(e))
                if lost is None:
                    raise
                raise lost from e
            if self.ranks is not None and self.ranks.exited():
                raise self._lost("")
            if self.step_timeout is not None and time.monotonic() - start > self.step_timeout:
                raise self._lost(f"the step did not finish within {self.step_timeout:g} s")

    def stop(self) -> dict[int, int]:
        """The stop plan to every rank, then their exit (rank -> status; {} under
        mlx.launch, which reaps its own). Children still running after that are killed."""
        if self._broken is None:
            self._wait(self._submit(self._broadcast, encode_stop()))
            self._calls.put((None, None, ()))
        return self.ranks.stop() if self.ranks is not None else {}

    def _lost(self, why: str) -> DistributedError | None:
        """The error of a step the ranks could not complete, after which the coordinator is
        broken; None for the step's own error (a rank was not lost)."""
        exits = None
        if self.ranks is not None:
            time.sleep(0.2)  # a killed child's exit is seen a moment after its socket closes
            exits = self.ranks.describe_exits()
        if exits is None and "[ring]" not in why and "within" not in why:
            return None
        self._broken = "; ".join(w for w in (exits, why) if w)
        return DistributedError(f"{self._broken}: the step could not complete")


def worker_loop(group: mx.distributed.Group, runner: ModelRunner,
                doorbell: int | None = None) -> int:
    """A rank > 0: run every plan rank 0 broadcasts, until the stop plan; returns the steps
    run. doorbell: a pipe rank 0 writes a byte to before the first broadcast after a sleep
    plan (start_ranks): once the server idles the rank blocks on it, not in a broadcast whose
    ring sockets busy-poll. Without one (mlx.launch) the sleep plan carries a nap: the rank
    sleeps that long, then joins the next broadcast, where rank 0 meets it."""
    steps = 0
    while True:
        t0 = time.perf_counter()
        plan = decode(broadcast(group))
        if plan.stop:
            return steps
        if plan.sleep:
            if plan.nap_s:
                time.sleep(plan.nap_s)
            elif doorbell is not None and not os.read(doorbell, 1):
                raise DistributedError("rank 0 closed the doorbell without a stop plan")
            continue
        t1 = time.perf_counter()
        out = runner.run(plan.groups, plan.path)
        _gather_times(group, t1 - t0, time.perf_counter() - t1, out)
        steps += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an mlx-lm model folder")
    p.add_argument("--weights", default="auto")
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--attention", default=NativeSetting.AUTO)
    p.add_argument("--row-kernels", default=NativeSetting.AUTO)
    p.add_argument("--tile", type=int, default=DEFAULT_TILE)
    p.add_argument("--activations", default="float32")
    p.add_argument("--time-collectives", type=int, default=0, help="1: time the all_sums")
    p.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--hostfile", required=True)
    p.add_argument("--run-dir")
    p.add_argument("--doorbell", type=int, help="the read end of the doorbell pipe")
    a = p.parse_args(argv)
    return run_rank(a.rank, lambda: join(a.rank, a.hostfile, a.run_dir, a.start_timeout),
                    a.model, a.weights, a.num_blocks, a.block_size, a.doorbell,
                    kv_dtype=a.kv_dtype, attention=a.attention, row_kernels=a.row_kernels,
                    tile=a.tile, activations=a.activations,
                    time_collectives=bool(a.time_collectives))


def run_rank(rank: int, join_group: Callable[[], mx.distributed.Group], model: str,
             weights: str, num_blocks: int, block_size: int, doorbell: int | None = None,
             **settings) -> int:
    """A rank > 0 from start to stop: join (`join_group`), load `model` at `weights`, shard it
    over a pool like rank 0's (settings: sharded_runner's) and run rank 0's plans until the
    stop plan. Returns the exit status; a failure is one line on stderr, status 1."""
    try:
        group = join_group()
        runner = sharded_runner(load_model(model, weights), group, num_blocks, block_size,
                                **settings)
        steps = worker_loop(group, runner, doorbell)
    except Exception as e:  # noqa: BLE001 - a rank's failure, reported and its exit status
        print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"rank {rank}: stopped after {steps} steps", file=sys.stderr, flush=True)
    return 0


def worker_args(model: str, num_blocks: int, block_size: int, *, weights: str = "auto",
                start_timeout: float = DEFAULT_START_TIMEOUT,
                **settings: str | int | bool) -> list[str]:
    """The command start_ranks runs for each rank > 0 over `model` (settings: kv_dtype,
    attention, row_kernels, tile, activations, time_collectives, as sharded_runner takes
    them; a bool goes as 1 or 0)."""
    args = [sys.executable, "-m", "engine.distributed.worker", "--model", model, "--weights",
            weights, "--num-blocks", str(num_blocks), "--block-size", str(block_size),
            "--start-timeout", str(start_timeout)]
    for name, value in settings.items():
        args += [f"--{name.replace('_', '-')}", str(int(value) if isinstance(value, bool)
                                                    else value)]
    return args


if __name__ == "__main__":
    sys.exit(main())
