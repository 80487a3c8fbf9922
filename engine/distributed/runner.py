"""The engine's runner over N ranks on this machine: rank 0's ModelRunner behind a Coordinator.

`start_sharded` refuses a model that cannot be split (check_shardable, before any rank
starts), starts ranks 1..N-1 (engine/distributed/worker.py over the same model folder, weights
and pool settings), shards rank 0's copy and builds its runner; `ShardedRunner.run` has
ModelRunner.run's signature, sends each step's plan to every rank and keeps the step's
StepTimes for the step record. Everything else (pool, describe_*, window_savings) is rank 0's
ModelRunner's.
"""

from __future__ import annotations

import json
import logging

from engine.config import EngineConfig, KernelPath
from engine.distributed.launch import DEFAULT_START_TIMEOUT, start_ranks
from engine.distributed.shard import check_shardable
from engine.distributed.worker import Coordinator, StepTimes, sharded_runner, worker_args
from engine.model_loader import LoadedModel
from engine.model_runner import ModelRunner, StepOutput
from engine.scheduler import RowGroup
from engine.telemetry import RankTimes

log = logging.getLogger("batchscope.engine")


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

    def rank_times(self) -> list[RankTimes]:
        """The last step's times per rank, for its StepRecord (empty: it failed)."""
        t = self.times
        if t is None:
            return []
        return [RankTimes(r, t.wall_s[r], t.model_s[r], t.broadcast_s[r])
                for r in range(len(t.wall_s))]

    def stop(self) -> dict[int, int]:
        """Every rank stopped (the stop plan, then killed past the timeout): rank -> status."""
        return self.coordinator.stop()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def start_sharded(cfg: EngineConfig, loaded: LoadedModel,
                  start_timeout: float = DEFAULT_START_TIMEOUT) -> ShardedRunner:
    """Rank 0 of cfg.tensor_parallel_size ranks over `loaded`, which must be cfg.model at
    cfg.weights: every other rank loads that itself. UnsupportedModelError (by name) before
    any rank starts for a model that cannot be split; DistributedError naming the rank that
    did not start in time or exited."""
    size = cfg.tensor_parallel_size
    check_shardable(loaded.model, size, loaded.config)
    settings = {"kv_dtype": cfg.kv_dtype, "attention": cfg.attention,
                "row_kernels": cfg.row_kernels, "tile": cfg.invariant_tile,
                "activations": cfg.activations}
    command = worker_args(cfg.model, cfg.num_kv_blocks, cfg.block_size, weights=cfg.weights,
                          start_timeout=start_timeout, **settings)
    group, ranks = start_ranks(size, command, timeout=start_timeout)
    try:
        hosts = json.loads((ranks.run_dir / "hostfile.json").read_text(encoding="utf-8"))
        ports = [int(h[0].rsplit(":", 1)[1]) for h in hosts]
        log.info("tensor parallel: %d ranks over the ring backend on 127.0.0.1: %s", size,
                 ", ".join(f"rank {r} port {p}" for r, p in enumerate(ports)))
        runner = sharded_runner(loaded, group, cfg.num_kv_blocks, cfg.block_size, **settings)
    except BaseException:
        for p in ranks.processes.values():
            p.kill()
        ranks.stop(timeout=1)
        raise
    return ShardedRunner(runner, Coordinator(group, runner, ranks), ports)
