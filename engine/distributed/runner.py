"""The engine's runner over N ranks on this machine: rank 0's ModelRunner behind a Coordinator.

`start_sharded` refuses a model that cannot be split (check_shardable, before any rank
starts), starts ranks 1..N-1 (engine/distributed/worker.py over the same model folder, weights
and pool settings), shards rank 0's copy and builds its runner; `ShardedRunner.run` has
ModelRunner.run's signature, sends each step's plan to every rank and keeps the step's
StepTimes for the step record. Everything else (pool, describe_*, window_savings) is rank 0's
ModelRunner's.
"""

from __future__ import annotations

import logging
import math
import os

import mlx.core as mx

from engine.config import EngineConfig, KernelPath
from engine.distributed.launch import (
    DEFAULT_START_TIMEOUT,
    DistributedError,
    hostfile_ports,
    join_from_env,
    launched_rank,
    start_ranks,
)
from engine.distributed.shard import check_shardable
from engine.distributed.worker import Coordinator, StepTimes, run_rank, sharded_runner, worker_args
from engine.model_loader import LoadedModel
from engine.model_runner import FinishedStep, ModelRunner, StepOutput
from engine.scheduler import RowGroup
from engine.telemetry import RankTimes

log = logging.getLogger("batchscope.engine")
# Seconds a step may take on ranks a launcher started: rank 0 cannot watch their processes, and
# the ring may wait for ever on a rank that is gone (a long prefill chunk takes seconds).
LAUNCHED_STEP_TIMEOUT = 300.0


class ShardedRunner:
    """ModelRunner.run over the ranks; `times` holds the last step's StepTimes."""

    # Every rank runs each plan when it is broadcast: a step is never queued behind another.
    queues_steps = False

    def __init__(self, runner: ModelRunner, coordinator: Coordinator, ports: list[int]):
        self.runner, self.coordinator, self.ports = runner, coordinator, ports
        self.times: StepTimes | None = None

    def run(self, groups: list[RowGroup], path: str = KernelPath.GEMM) -> StepOutput:
        """The step on every rank; DistributedError naming the rank when one is lost."""
        self.times = None  # a failed step has no times
        out, self.times = self.coordinator.step(groups, path)
        return out

    def launch(self, groups: list[RowGroup], path: str = KernelPath.GEMM,
               tokens: None = None) -> FinishedStep:
        """`run`, as ModelRunner.launch reads: the step is computed before this returns."""
        if tokens is not None:
            raise ValueError("a step over ranks takes its tokens from its plan")
        return FinishedStep(self.run(groups, path))

    def rank_times(self) -> list[RankTimes]:
        """The last step's times per rank, for its StepRecord (empty: it failed)."""
        t = self.times
        if t is None:
            return []
        return [RankTimes(r, t.wall_s[r], t.model_s[r], t.broadcast_s[r],
                          None if math.isnan(t.all_sum_s[r]) else t.all_sum_s[r])
                for r in range(len(t.wall_s))]

    def stop(self) -> dict[int, int]:
        """Every rank stopped (the stop plan, then killed past the timeout): rank -> status."""
        return self.coordinator.stop()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def runner_settings(cfg: EngineConfig) -> dict:
    """What every rank's runner is built with besides the pool's size (sharded_runner)."""
    return {"kv_dtype": cfg.kv_dtype, "attention": cfg.attention,
            "row_kernels": cfg.row_kernels, "tile": cfg.invariant_tile,
            "activations": cfg.activations, "time_collectives": cfg.time_collectives}


def launched_group(cfg: EngineConfig, start_timeout: float) -> mx.distributed.Group:
    """The group a launcher started this process in (mlx.launch), checked against cfg."""
    group = join_from_env(start_timeout)
    if group.size() != cfg.tensor_parallel_size:
        raise DistributedError(f"the launcher started {group.size()} ranks, "
                               f"--tensor-parallel-size is {cfg.tensor_parallel_size}: pass "
                               "the number of ranks")
    return group


def start_sharded(cfg: EngineConfig, loaded: LoadedModel,
                  start_timeout: float = DEFAULT_START_TIMEOUT) -> ShardedRunner:
    """Rank 0 of cfg.tensor_parallel_size ranks over `loaded`, which must be cfg.model at
    cfg.weights: every other rank loads that itself. The ranks are started here, or, where a
    launcher started this process (mlx.launch: launched_rank), joined as it set them up.
    UnsupportedModelError (by name) before any rank starts for a model that cannot be split;
    DistributedError naming the rank that did not start in time or exited."""
    size = cfg.tensor_parallel_size
    check_shardable(loaded.model, size, loaded.config)
    settings = runner_settings(cfg)
    rank = launched_rank()
    if rank is not None:
        if rank != 0:
            raise DistributedError(f"the engine runs on rank 0; this process is rank {rank} "
                                   "(serve_rank runs the others)")
        group = launched_group(cfg, start_timeout)
        ports = hostfile_ports(os.environ["MLX_HOSTFILE"])
        log.info("tensor parallel: %d ranks started by a launcher: %s", size,
                 ", ".join(f"rank {r} port {p}" for r, p in enumerate(ports)))
        runner = sharded_runner(loaded, group, cfg.num_kv_blocks, cfg.block_size, **settings)
        return ShardedRunner(runner, Coordinator(group, runner, None, LAUNCHED_STEP_TIMEOUT),
                             ports)
    command = worker_args(cfg.model, cfg.num_kv_blocks, cfg.block_size, weights=cfg.weights,
                          start_timeout=start_timeout, **settings)
    group, ranks = start_ranks(size, command, timeout=start_timeout)
    try:
        ports = hostfile_ports(ranks.run_dir / "hostfile.json")
        log.info("tensor parallel: %d ranks over the ring backend on 127.0.0.1: %s", size,
                 ", ".join(f"rank {r} port {p}" for r, p in enumerate(ports)))
        runner = sharded_runner(loaded, group, cfg.num_kv_blocks, cfg.block_size, **settings)
    except BaseException:
        for p in ranks.processes.values():
            p.kill()
        ranks.stop(timeout=1)
        raise
    return ShardedRunner(runner, Coordinator(group, runner, ranks), ports)


def serve_rank(cfg: EngineConfig, start_timeout: float = DEFAULT_START_TIMEOUT) -> int:
    """A rank > 0 that a launcher started (mlx.launch runs the same command on every rank):
    engine/distributed/worker.py's run_rank over the launcher's group. Returns the exit
    status."""
    settings = runner_settings(cfg)
    return run_rank(launched_rank(), lambda: launched_group(cfg, start_timeout), cfg.model,
                    cfg.weights, cfg.num_kv_blocks, cfg.block_size, **settings)
