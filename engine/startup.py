"""The engine's start-up pieces kept out of engine/engine.py: its model runner (this process,
or rank 0 of N over engine/distributed/) and what it logs once the model is ready."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import mlx.core as mx

from engine.config import EngineConfig
from engine.distributed.launch import DistributedError
from engine.distributed.runner import ShardedRunner, start_sharded
from engine.distributed.worker import pool_dtype
from engine.model_loader import LoadedModel
from engine.model_runner import ModelRunner, pool_for
from engine.models import Family
from engine.platform import TF32_ENV, backend_info, blas_text
from engine.state_pool import StatePool
from engine.telemetry import RankTimes

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("batchscope.engine")


def build_runner(cfg: EngineConfig, loaded: LoadedModel, family: Family,
                 states: StatePool | None, custom_loader: bool) -> ModelRunner | ShardedRunner:
    """The step's runner: over this process's pool, or (tensor_parallel_size > 1) rank 0's
    over its shard, with the other ranks started here (engine/distributed/runner.py)."""
    if cfg.tensor_parallel_size == 1:
        return ModelRunner(loaded.model, pool_for(family, cfg.num_kv_blocks, cfg.block_size,
                                                  pool_dtype(cfg.kv_dtype)),
                           cfg.attention, cfg.row_kernels,
                           family, tile=cfg.invariant_tile, states=states,
                           activations=cfg.activations)
    if custom_loader:  # the other ranks load cfg.model: a model given otherwise could differ
        raise DistributedError("tensor parallelism loads --model on every rank; an engine "
                               "given its own loader cannot be split")
    return start_sharded(cfg, loaded)


def log_model(engine: Engine, family: Family, states: StatePool | None) -> None:
    """The start-up lines about the model, its kernels and its pools."""
    cfg, loaded = engine.config, engine.loaded
    if states is not None:
        log.info("state pool: %s; the recurrence on %s", states.describe(engine.state_slots),
                 "the native kernel" if engine.runner.recurrence_kernel is not None
                 and states.conv_dtype == mx.float32 else "MLX ops")
    info = backend_info()
    log.info("model %s (%s family, %s weights) on %s, BLAS %s; KV pool %d blocks x %d "
             "tokens; context %d; attention: %s; row kernels: %s",
             loaded.name, family.name, loaded.weights, info["backend"],
             blas_text(info), cfg.num_kv_blocks, cfg.block_size,
             engine.max_model_len, engine.attention, engine.row_kernels)
    if info["backend"] != "cpu":
        log.info("float32 matmuls: %s (%s)", info["float32_matmuls"], TF32_ENV)
        if info["float32_matmuls"] == "tf32" and loaded.weights == "f32":
            log.warning("f32 weights with TF32 on: float32 matmuls keep 10 mantissa bits, "
                        "and the tokens may differ from mlx-lm's float32 ones")
    for line in family.describe_layers():
        log.info("layers: %s", line)


def rank_times(runner: ModelRunner | ShardedRunner | None) -> list[RankTimes]:
    """The last step's times per rank (empty for one rank)."""
    return runner.rank_times() if isinstance(runner, ShardedRunner) else []


def stop_ranks(runner: ModelRunner | ShardedRunner | None) -> None:
    """Every other rank stopped, none left behind (nothing to do for one rank)."""
    if isinstance(runner, ShardedRunner):
        log.info("ranks stopped: %s", runner.stop())
