"""One engine step on the model: packed rows in, logits and sampled tokens out.

All of a step's token positions (prefill chunks and decode rows) are packed into one
(1, rows, hidden) input, so each linear layer sees exactly the step's rows. The runner routes
them: the model family (engine/models/, which reuse mlx-lm's modules and weights) computes the
layers over an engine/step.py Step, whose operations run on the native ops where they apply
(engine/native_ops.py, which this runner is) and attend per sequence through the paged pool
(engine/attention.py). Logits are computed only for the rows that are sampled, and
engine/sampler.py turns them into tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.config import DEFAULT_TILE, EngineConfig, KernelPath, NativeSetting
from engine.kernels import PathTaken
from engine.kv_cache import KVPool
from engine.models import Family, family_for
from engine.native_ops import (
    WIDENS_EXACTLY,
    NativeLayer,
    NativeOps,
    pool_copy_kernel,
    recurrence_kernel,
)
from engine.sampler import Draw, Sampled, draw
from engine.scheduler import RowGroup
from engine.state_pool import StatePool
from engine.state_slots import StateSlots
from engine.step import Step, slots


@dataclass
class StepOutput:
    # seq_id -> what the group emits, for groups with sample=True: one token, or for a verify
    # group its accepted drafts (how many: Sampled.accepted) and then the target's own token
    sampled: dict[str, Sampled]
    model_time: float  # seconds: forward + sampling, evaluated
    traces: dict[str, StepTrace] = field(default_factory=dict)  # seq_id -> what it wrote
    # Mixture-of-experts layers: layer index -> rows each expert received (the router's choice)
    expert_rows: dict[int, list[int]] = field(default_factory=dict)
    # The path the step's matmul calls took ("native" where all ran on the native kernels,
    # engine/kernels.py PathTally); None: no forward ran (an empty step)
    taken: PathTaken | None = None

    @property
    def samples(self) -> dict[str, list]:
        """seq_id -> the samples each sampled group emits."""
        return {seq_id: s.samples for seq_id, s in self.sampled.items()}


@dataclass
class StepTrace:
    """What one traced sequence's rows produced in a step, copied out of MLX."""

    kv: np.ndarray  # (layers, 2 [keys, values], kv_heads, rows, head_dim), float32
    # (vocab,) float32 at the sampled row, or None (no sample); a verify group: (rows, vocab)
    logits: np.ndarray | None
    # Models with recurrent layers: its recurrent state after the step (layers, v_heads,
    # v_dim, k_dim), float32; None otherwise
    state: np.ndarray | None = None


@dataclass
class PendingStep:
    """A launched step (ModelRunner.launch): its graph is queued; result() waits for it."""

    runner: ModelRunner
    groups: list[RowGroup]
    step: Step
    logits_rows: mx.array | None
    sampled: list[RowGroup]
    samples: Draw | None  # None: no group samples (the step was evaluated at launch)
    launched: float  # perf_counter at launch

    def result(self, since: float | None = None) -> StepOutput:
        """What the step emits. since: when its computation could start (perf_counter; a step
        launched behind another starts when that one ends), for model_time; default: launch."""
        out = self.samples.read() if self.samples is not None else {}
        groups = self.groups
        traces = (self.runner._traces(groups, self.logits_rows, self.sampled, out)
                  if any(g.trace for g in groups) else {})
        start = self.launched if since is None else max(since, self.launched)
        return StepOutput(sampled=out, model_time=time.perf_counter() - start, traces=traces,
                          expert_rows=self.step.expert_rows(), taken=self.step.tally.taken())


@dataclass
class FinishedStep:
    """A step computed at launch, as a PendingStep reads (a runner that cannot queue steps)."""

    output: StepOutput

    def result(self, since: float | None = None) -> StepOutput:
        return self.output


def pool_for(family: Family, num_blocks: int, block_size: int,
             dtype: mx.Dtype | None = None) -> KVPool:
    """The paged pool a family's layers need: one pool layer per layer that writes keys and
    values, each with that layer's kv_heads and head_dim; dtype None: the model's."""
    writers = sorted({kv.pool_layer: kv for kv in family.layer_kv() if kv.writes}.items())
    return KVPool(len(writers), num_blocks, block_size, [kv.kv_heads for _, kv in writers],
                  [kv.head_dim for _, kv in writers], dtype)


def state_pool_for(family: Family, cfg: EngineConfig) -> tuple[StateSlots, StatePool] | None:
    """The state slots and pool a family's recurrent layers need (None: it has none): a live
    slot per sequence that may run, a scratch slot per draft a step may verify, and as many
    checkpoints as the memory budget allows (no more than the KV pool has checkpoint
    positions)."""
    layers = family.recurrent_layers()
    if not layers:
        return None
    spec = cfg.speculation
    scratch = spec.num_tokens * min(cfg.max_num_seqs, spec.max_batch) if spec.enabled else 0
    slot_bytes = sum(s.slot_bytes(family.conv_dtype()) for s in layers)
    positions = cfg.num_kv_blocks * cfg.block_size // cfg.state_checkpoint_interval
    checkpoints = (min(cfg.state_checkpoint_mib * 2**20 // slot_bytes, positions)
                   if cfg.enable_prefix_caching else 0)
    slots = StateSlots(cfg.state_slots or cfg.max_num_seqs, scratch, checkpoints,
                       interval=cfg.state_checkpoint_interval, slot_bytes=slot_bytes)
    return slots, StatePool(layers, slots.total, family.conv_dtype())


class ModelRunner(NativeOps):
    """A model over its paged pool: runs groups of rows (RowGroup) and returns what they emit;
    the native ops it computes with are its base (engine/native_ops.py)."""

    queues_steps = True  # launch() queues a step behind one still computing (engine/lookahead.py)

    def __init__(self, model, pool: KVPool, attention: str = NativeSetting.AUTO,
                 row_kernels: str = NativeSetting.AUTO, family: Family | None = None, *,
                 tile: int = DEFAULT_TILE, stacks: dict | None = None,
                 states: StatePool | None = None, activations: str = "float32"):
        """model: a loaded mlx-lm model; its family adapter is looked up by model_type
        (engine/models/) unless given. Raises UnsupportedModelError for one it cannot run.
        tile: rows per call on the batch-invariant ("tiled") path. stacks: the `stacks` of a
        runner over the same modules (a layers:N draft shares the target's). states: the
        recurrent layers' state pool (state_pool_for), for a family that has such layers.
        activations: engine.config.ACTIVATIONS, for the affine-quantized layers."""
        super().__init__(model, attention, row_kernels, stacks, activations)
        self.family = family or family_for(model)
        self.pool = pool
        self.states = states
        if (states is None) != (not self.family.recurrent_layers()):
            raise ValueError(f"{self.family.name}: a state pool is needed exactly for a model "
                             "with recurrent layers")
        self.recurrence_kernel = recurrence_kernel(attention, self.fused_attention)
        pool.copy_op = pool_copy_kernel(attention, self.fused_attention)
        self.tile = tile
        self.layer_kv = self.family.layer_kv()
        # The sliding windows of the layers that write keys and values (empty: none).
        self.windows = [kv.window for kv in self.layer_kv if kv.window and kv.writes]
        pool_layers = 1 + max(kv.pool_layer for kv in self.layer_kv)
        if pool.num_layers != pool_layers:
            raise ValueError(f"the pool has {pool.num_layers} layers, the model {pool_layers}")
        self._fused: dict[int, NativeLayer | None] = {}  # layer -> its fused op's spec

    def window_savings(self, groups: list[RowGroup]) -> dict[str, int]:
        """What the sliding layers no longer read in these groups' sequences after the step:
        whole blocks before every sliding layer's window, which the pool keeps for the global
        layers (a StepRecord's window_blocks_behind and window_bytes_reclaimable)."""
        if not self.windows:
            return {}
        window = max(self.windows)  # behind the widest window, no sliding layer reads a block
        pool = self.pool
        # After this step a sequence's rows see positions > context - window.
        behind = sum(max(0, g.start + g.num_rows - window + 1) // pool.block_size
                     for g in groups)
        itemsize = pool.dtype.size if pool.dtype is not None else 4
        block_bytes = sum(2 * pool.kv_heads[kv.pool_layer] * pool.head_dims[kv.pool_layer]
                          * pool.block_size * itemsize
                          for kv in self.layer_kv if kv.window and kv.writes)
        return {"window_blocks_behind": behind, "window_bytes_reclaimable": behind * block_bytes}

    def fused_layer_of(self, i: int) -> NativeLayer | None:
        """Layer i as the fused op takes it (NativeOps.fused_layer of the family's spec, made
        on first use), or None where the layer has no fused op: the family names no spec, or
        the layer reads another layer's keys."""
        if i not in self._fused:
            spec = self.family.fused_layer_spec(i)
            kv = self.layer_kv[i]
            self._fused[i] = (self.fused_layer(spec, self.pool.block_size, kv.window or 0)
                              if spec is not None and kv.writes else None)
        return self._fused[i]

    def decoder_layers(self, step: Step, i: int, x: mx.array) -> tuple[mx.array, int] | None:
        """Layers i, i + 1, ... as one native op (engine/native/decoder_layer.h): each one's
        norms, q/k/v, RoPE, the KV write, paged attention, o, SwiGLU MLP and residuals, for as
        many consecutive layers as take it on this step and share layer i's window. Returns
        (the output, how many layers it took), or None where layer i would take another path
        than its native ops, so the op gives exactly the bits of the op-by-op layers
        (tests/engine/test_decoder_layer.py). A "tiled" step takes it too: its parts take their
        native ops there as well (NativeOps.linear), each row alone."""
        op = self.layer_kernel
        if op is None or step.path == KernelPath.GEMV or x.dtype not in WIDENS_EXACTLY:
            return None
        rows, window = x.shape[1], self.layer_kv[i].window
        specs, k_pools, v_pools = [], [], []
        for j in range(i, len(self.layer_kv)):
            layer, kv = self.fused_layer_of(j), self.layer_kv[j]
            if layer is None or rows > layer.max_rows or kv.window != window:
                break
            specs.append(layer.spec)
            # The op writes the rows' keys and values into these arrays when it is evaluated
            # (decoder_layer.h): the step's output depends on it, and _forward evaluates that.
            k_pool, v_pool = self.pool.writable(kv.pool_layer, mx.float32)
            k_pools.append(k_pool)
            v_pools.append(v_pool)
        if not specs:
            return None
        # A float16 or bfloat16 x (a quantized embedding's output) is widened exactly: a
        # layer reads x through its norm (NativeOps.norm widens it) and the residual sum
        # (which widens it), so the op-by-op layer computes on these same values.
        plan = step.plan(window)
        out = op(x.astype(mx.float32), specs, k_pools, v_pools, step.write, step.pos,
                 plan.tables, plan.lens, plan.query_lens)
        return out, len(specs)

    def run(self, groups: list[RowGroup], path: str = KernelPath.GEMM) -> StepOutput:
        """One forward over the groups' rows, every linear layer along `path` (or the native
        kernels where they take it: StepOutput.taken says which)."""
        return self.launch(groups, path).result()

    def launch(self, groups: list[RowGroup], path: str = KernelPath.GEMM,
               tokens: mx.array | None = None) -> PendingStep:
        """`run`'s step with its graph built and queued for evaluation, not waited for.
        tokens: the rows' input tokens as an array, which may still be computing (the samples
        of a step launched before: engine/lookahead.py); None: the groups' token_ids."""
        t0 = time.perf_counter()
        step = Step(self, groups, path, tokens)
        logits_rows, sampled = self._forward(step, groups)
        samples = (draw(logits_rows, sampled, self.logsumexp, self._state_arrays(), self.greedy)
                   if sampled else None)
        return PendingStep(self, groups, step, logits_rows, sampled, samples, t0)

    def _state_arrays(self) -> list[mx.array]:
        """The pools a step writes, evaluated with it."""
        return self.pool.state() + (self.states.state() if self.states is not None else [])

    def _traces(self, groups, logits_rows, sampled, out_sampled) -> dict[str, StepTrace]:
        """Copy the keys and values each traced group just wrote, and its logits. Pool layers
        of other shapes (gemma4's sliding and full layers) are zero-padded to the widest
        kv_heads and head_dim, so StepTrace.kv stays one array: the padding is equal on both
        sides of a comparison and adds no difference."""
        bs = self.pool.block_size
        heads, dim = max(self.pool.kv_heads), max(self.pool.head_dims)
        out = {}
        for g in groups:
            if not g.trace:
                continue
            written = mx.array(slots(g.block_table, g.start + g.num_rows, bs)[g.start:])
            layers = []
            for layer in range(self.pool.num_layers):
                kv = mx.stack(self.pool.read(layer, written))  # (2, kv_heads, rows, head_dim)
                pad = [(0, 0), (0, heads - kv.shape[1]), (0, 0), (0, dim - kv.shape[3])]
                layers.append(mx.pad(kv, pad) if kv.shape[1] != heads or kv.shape[3] != dim
                              else kv)
            kv = mx.stack(layers)
            logits = None
            if g.sample:
                at = sum(s.sampled_rows for s in sampled[:sampled.index(g)])
                rows = logits_rows[at:at + g.sampled_rows].astype(mx.float32)
                logits = np.array(rows if g.verify else rows[0])
            state = None
            if self.states is not None:  # a verify group goes on from its last kept row's
                kept = g.verify and out_sampled[g.seq_id].accepted < len(g.drafts)
                slot = (dict(g.snapshots)[out_sampled[g.seq_id].accepted] if kept
                        else g.state_slot)
                state = np.array(self.states.read(slot))
            out[g.seq_id] = StepTrace(np.array(kv.astype(mx.float32)), logits, state)
        return out

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, step: Step,
                 groups: list[RowGroup]) -> tuple[mx.array | None, list[RowGroup]]:
        family = self.family
        x = family.embed(step, step.tokens)  # (1, rows, hidden)
        i = 0
        while i < len(self.layer_kv):
            fused = step.decoder_layers(i, x)  # layers i, ... as one native op, where it can
            if fused is not None:
                x, i = fused[0], i + fused[1]
            else:
                x, i = family.layer(step, i, x), i + 1

        sampled = [g for g in groups if g.sample]
        if not sampled:
            # x too: fused layers (decoder_layers) write the pool when their output is evaluated.
            mx.eval(x, self._state_arrays())
            return None, []
        rows, r = [], 0
        for g in groups:
            r += g.num_rows
            rows.extend(range(r - g.sampled_rows, r))
        # Every row sampled (a decode step): x as it is, not a gather of all its rows.
        sampled_x = x if len(rows) == r else x[:, mx.array(rows)]
        logits = family.head(step, sampled_x)  # (1, sampled rows, vocab)
        return logits.squeeze(0), sampled  # a view: no gather of row 0
