"""One engine step on the model: packed rows in, sampled tokens out.

All of a step's token positions (prefill chunks and decode rows) are packed into one
(1, rows, hidden) input, so each linear layer sees exactly the step's rows. Attention is done
per sequence, reading its keys and values from the paged pool through its block table with its
own causal offset (engine/attention.py: the native kernel for all rows on the CPU, MLX ops
otherwise). What the layers compute is the model family's (engine/models/, which reuse
mlx-lm's modules and weights); this file only routes rows. Logits are computed only for the
rows that are sampled.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import native
from engine.attention import StepAttention, attend_step, plan_step, use_fused_attention
from engine.config import check_native_setting
from engine.kernels import apply_experts, apply_linear
from engine.kv_cache import KVPool
from engine.models import Family, family_for
from engine.models.base import head_dim as _head_dim
from engine.sampling import SamplingParams
from engine.speculative import accepted_prefix

NEG_INF = float("-inf")
# Up to this many rows a "gemm" step's float32 linear layers go to the native kernel: in
# benchmarks/decode_linear.py it is faster than MLX's BLAS matmul at every row count up to 32
# (1.2-1.8x here), and the gap closes above.
DECODE_MATMUL_MAX_ROWS = 32
# The same for MLX's affine-quantized layers (the shipped 4-bit linears and 8-bit tied head):
# the native quantized kernel. On the CPU MLX's quantized_matmul computes one row at a time,
# and the kernel is faster at every row count measured over the whole model: 7x at 1 row and
# 16-55x from 4 to 128 (benchmarks/decode_linear.py --weights q4, results/decode_quantized.md;
# `--rows 512 2048` measures larger steps). Since MLX's cost grows with every row, every gemm
# step up to this many rows takes it, and a row gets the same bits in every such step.
DECODE_QUANTIZED_MAX_ROWS = 4096


@dataclass
class RowGroup:
    """The rows one sequence contributes to a step."""

    seq_id: str
    token_ids: list[int]  # the tokens at positions [start, start + len)
    start: int  # position of the first row
    block_table: list[int]
    sample: bool  # the group ends at the sequence's last token: sample the next one
    params: SamplingParams | None = None
    output_index: int = 0  # index of the token to be sampled (seeds the per-request RNG)
    trace: bool = False  # return this group's written KV rows and its logits (divergence view)
    # token_ids[1:] are drafted tokens to verify (engine/speculative.py): every row is sampled
    # and the longest agreeing prefix is kept.
    verify: bool = False

    @property
    def sampled_rows(self) -> int:
        """Rows whose logits the step needs: all of a verify group's, else the last one."""
        return self.num_rows if self.verify else int(self.sample)

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)


@dataclass
class Sample:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives
    drafted: bool = False  # a drafted token the target accepted


@dataclass
class StepOutput:
    # seq_id -> the tokens the group emits, for groups with sample=True: one, or for a verify
    # group its accepted drafts and then the target's own next token
    samples: dict[str, list[Sample]]
    model_time: float  # seconds: forward + sampling, evaluated
    traces: dict[str, StepTrace] = field(default_factory=dict)  # seq_id -> what it wrote
    # Mixture-of-experts layers: layer index -> rows each expert received (the router's choice)
    expert_rows: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class StepTrace:
    """What one traced sequence's rows produced in a step, copied out of MLX."""

    kv: np.ndarray  # (layers, 2 [keys, values], kv_heads, rows, head_dim), float32
    # (vocab,) float32 at the sampled row, or None (no sample); a verify group: (rows, vocab)
    logits: np.ndarray | None


def pool_for(family: Family, num_blocks: int, block_size: int,
             dtype: mx.Dtype | None = None) -> KVPool:
    """The paged pool a family's layers need: one pool layer per layer that writes keys and
    values, each with that layer's kv_heads and head_dim; dtype None: the model's."""
    writers = sorted({kv.pool_layer: kv for kv in family.layer_kv() if kv.writes}.items())
    return KVPool(len(writers), num_blocks, block_size, [kv.kv_heads for _, kv in writers],
                  [kv.head_dim for _, kv in writers], dtype)


class Step:
    """One forward as a model family sees it (engine/models/): the step's rows, their
    positions, and the operations that depend on the engine rather than the family (linear
    layers along the step's kernel path, RoPE at each row's position, paged attention)."""

    def __init__(self, runner: ModelRunner, groups: list[RowGroup]):
        self.runner = runner
        bs = runner.pool.block_size
        tokens, positions, write_slots, self.contexts = [], [], [], []
        for g in groups:
            tokens.extend(g.token_ids)
            positions.extend(range(g.start, g.start + g.num_rows))
            ctx_len = g.start + g.num_rows
            write_slots.append(_slots(g.block_table, ctx_len, bs)[g.start:])
            self.contexts.append((g.num_rows, ctx_len, g.block_table))
        self.tokens = mx.array(tokens)
        self.rows = len(tokens)
        self.pos = mx.array(positions, dtype=mx.int32)
        slots = np.concatenate(write_slots)
        self.write = mx.array(slots.astype(np.int32))  # pool slots (int32: the fused op's)
        self._plans: dict[tuple[int | None, bool], StepAttention] = {}  # (window, sinks)
        self.expert_choices: list[tuple[int, int, mx.array]] = []  # (layer, experts, indices)

    def linear(self, module, x: mx.array, tied: bool = False) -> mx.array:
        """A linear layer (tied=True: an embedding used as the output head)."""
        return self.runner.linear(module, x, tied)

    def linears(self, modules: list, x: mx.array) -> list[mx.array]:
        """Several linear layers over the same input (q/k/v, gate/up): the same results as
        one `linear` each, in fewer calls where the step's kernel allows."""
        return self.runner.linears(modules, x)

    def rope(self, rope, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        """q: (rows, heads, dim), k: (rows, kv_heads, dim), rotated at each row's position.

        On the CPU the native op rotates each at its rows' positions (engine/native/row_ops.h).
        Otherwise each row is its own "batch" entry so MLX's RoPE takes a per-row position, and
        queries and keys go through one call, half the calls: RoPE rotates each head alone, so
        the bits are those of two calls (tests/engine/test_attention.py)."""
        native_rope = self.runner.native_rope(rope, q, k)
        if native_rope is not None:
            op, inv_freqs, scale = native_rope
            return tuple(op(x, self.pos, inv_freqs, rope.dims, rope.traditional, scale)
                         for x in (q, k))
        n = q.shape[1]
        qk = rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=self.pos)[:, :, 0, :]
        return qk[:, :n], qk[:, n:]

    def norm(self, module, x: mx.array) -> mx.array:
        """An RMS norm module (mlx-lm's nn.RMSNorm) on x: the native op where it applies."""
        return self.runner.norm(module, x)

    def attend(self, i: int, q: mx.array, k: mx.array | None, v: mx.array | None,
               scale: float, sinks: mx.array | None = None) -> mx.array:
        """Layer i's attention: store the rows' keys and values (unless the layer reads
        another layer's), then each row attends over its own context. sinks: (heads,) logits
        that join each row's softmax (gpt_oss). Returns (rows, heads * dim)."""
        runner = self.runner
        kv = runner.layer_kv[i]
        if kv.writes:
            runner.pool.write(kv.pool_layer, self.write, k, v)
        return attend_step(q, self.plan(kv.window, sinks is not None), runner.pool,
                           kv.pool_layer, scale, runner.fused_attention,
                           runner.attention_kernel, sinks)

    def plan(self, window: int | None, sinks: bool = False) -> StepAttention:
        """How this step's rows attend in a layer with this window (made once per step)."""
        key = (window, sinks)
        plan = self._plans.get(key)
        if plan is None:
            # The native kernel has no sinks: such a layer's decode rows take MLX ops.
            native = self.runner.attention_kernel is not None and not sinks
            plan = self._plans[key] = plan_step(self.contexts, self.runner.pool.block_size,
                                                native, window)
        return plan

    def decoder_layer(self, i: int, layer, x: mx.array, qk_norm: bool = False,
                      rope: bool = True) -> mx.array | None:
        """Layer i of a llama-style block (engine/models/base.py's llama_layer) as one native
        op, or None where the step computes it op by op: the same bits either way."""
        return self.runner.decoder_layer(self, i, layer, x, qk_norm, rope)

    def experts(self, i: int, switch, x: mx.array, indices: mx.array,
                num_experts: int) -> mx.array:
        """Layer i's routed experts: `switch` is mlx-lm's expert block (SwitchGLU:
        switch(x, indices) with gather matmuls), x (1, rows, hidden), indices (1, rows, k) the
        router's choice. The step's kernel path decides the calls (engine/kernels.py); the
        choice is recorded (StepOutput.expert_rows)."""
        self.expert_choices.append((i, num_experts, indices))
        runner = self.runner
        return apply_experts(switch, x, indices, runner.path, runner.tile)

    def expert_rows(self) -> dict[int, list[int]]:
        """Rows per expert in each MoE layer, from the evaluated router choices."""
        return {i: np.bincount(np.array(indices).reshape(-1), minlength=n).tolist()
                for i, n, indices in self.expert_choices}


class ModelRunner:
    def __init__(self, model, pool: KVPool, attention: str = "auto",
                 decode_matmul: str = "auto", family: Family | None = None):
        """model: a loaded mlx-lm model; its family adapter is looked up by model_type
        (engine/models/) unless given. Raises UnsupportedModelError for one it cannot run."""
        self.family = family or family_for(model)
        self.model = model
        self.pool = pool
        self.layer_kv = self.family.layer_kv()
        # The sliding windows of the layers that write keys and values (empty: none).
        self.windows = [kv.window for kv in self.layer_kv if kv.window and kv.writes]
        pool_layers = 1 + max(kv.pool_layer for kv in self.layer_kv)
        if pool.num_layers != pool_layers:
            raise ValueError(f"the pool has {pool.num_layers} layers, the model {pool_layers}")
        self.fused_attention = use_fused_attention()
        self.attention_kernel = _attention_kernel(attention, self.fused_attention)
        self.matmul_kernel = _matmul_kernel(decode_matmul, self.fused_attention)
        self.quantized_kernel = _quantized_kernel(decode_matmul, self.fused_attention)
        # RMS norm, RoPE and the sampler's logsumexp as one native op each
        # (engine/native/row_ops.h), with the native linear kernels: "mlx" keeps MLX's own ops
        # for all of a row's math.
        self.row_ops = _row_ops(decode_matmul, self.fused_attention)
        # A llama-style layer as one op where all of its parts take the native ops above.
        self.layer_kernel = _layer_kernel(decode_matmul, self.fused_attention)
        self._layer_ops: dict[tuple, tuple] = {}  # (layer, qk_norm, rope) -> (module, args)
        self._rope_freqs: dict[int, tuple] = {}  # id(rope) -> (rope, _rope_freqs(rope))
        self.path = "gemm"
        self.tile = 16  # rows per call on the batch-invariant ("tiled") path
        self._stacks: dict[tuple[int, ...], tuple] = {}  # ids -> (modules, kind, arrays)

    @property
    def window_block_bytes(self) -> int:
        """Bytes one block holds across the sliding layers' pool layers."""
        pool = self.pool
        itemsize = pool.dtype.size if pool.dtype is not None else 4
        return sum(2 * pool.kv_heads[kv.pool_layer] * pool.head_dims[kv.pool_layer]
                   * pool.block_size * itemsize
                   for kv in self.layer_kv if kv.window and kv.writes)

    @property
    def native_matmul_applies(self) -> bool:
        """Whether few-row gemm steps reach the native kernel (float32 linear layers)."""
        return self.matmul_kernel is not None and any(
            _float32_weight(m) is not None for m in self.model.modules())

    @property
    def native_quantized_applies(self) -> bool:
        """Whether gemm steps reach the native quantized kernel (affine 4/8-bit layers)."""
        return self.quantized_kernel is not None and any(
            quantized_weight(m, kind) is not None for m in self.model.modules()
            for kind in (nn.QuantizedLinear, nn.QuantizedEmbedding))

    # The one place a linear layer runs: the step's kernel path decides how. A "gemm" step of
    # few rows takes the native kernel for float32 weights, and one of up to
    # DECODE_QUANTIZED_MAX_ROWS the native quantized kernel for affine-quantized ones (one
    # call, each row on its own).
    def linear(self, module, x: mx.array, tied: bool = False) -> mx.array:
        if self.path == "gemm":
            rows = x.shape[1]
            out = None
            if self.matmul_kernel is not None and rows <= DECODE_MATMUL_MAX_ROWS:
                weight = _float32_weight(module, nn.Embedding if tied else nn.Linear)
                if weight is not None:
                    out = self.matmul_kernel(x, weight)
            if (out is None and self.quantized_kernel is not None
                    and rows <= DECODE_QUANTIZED_MAX_ROWS and x.dtype == mx.float32):
                q = quantized_weight(module, nn.QuantizedEmbedding if tied else nn.QuantizedLinear)
                if q is not None:
                    out = self.quantized_kernel(x, *q)
            if out is not None:
                bias = getattr(module, "bias", None)
                return out if bias is None else out + bias
        return apply_linear(module.as_linear if tied else module, x, self.path, self.tile)

    def linears(self, modules: list, x: mx.array) -> list[mx.array]:
        """Linear layers that share an input. On a few-row "gemm" step the native kernels take
        them as one call over their weights stacked by output (ModelRunner._stacked): each
        output's arithmetic in those kernels depends on its own weights alone, so the bits are
        those of one call per layer, with a fraction of the calls."""
        stacked = self._stacked(modules, x) if self.path == "gemm" else None
        if stacked is None:
            return [self.linear(m, x) for m in modules]
        out = stacked(x)
        parts, at = [], 0
        for m in modules:
            n = m.weight.shape[0]
            part = out[..., at:at + n]
            at += n
            bias = getattr(m, "bias", None)
            parts.append(part if bias is None else part + bias)
        return parts

    def _stacked(self, modules: list, x: mx.array):
        """The one native call for `modules` on x (a function of x), or None where a layer
        would not take a native kernel on this step."""
        found = self._native_weights(modules, x.shape[1], x.dtype)
        if found is None:
            return None
        arrays, bits, group_size = found
        if bits == 0:
            return lambda v: self.matmul_kernel(v, arrays[0])
        return lambda v: self.quantized_kernel(v, *arrays, group_size, bits)

    def _native_weights(self, modules: list, rows: int,
                        dtype: mx.Dtype) -> tuple[list, int, int] | None:
        """(arrays, bits, group_size) of the native kernel that takes `modules` stacked by
        output on a step of `rows` rows of `dtype`: ([weight], 0, 0) for float32, ([w, scales,
        biases], bits, group_size) for affine-quantized; None where none would. The stacked
        weights are made on first use and the layers' own weights become views of them, so no
        memory is added (a single layer is taken as it is)."""
        key = tuple(id(m) for m in modules)
        entry = self._stacks.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], modules, strict=True)):
            entry = self._stacks[key] = (modules, *self._stack(modules))  # modules kept alive
        _, kind, arrays = entry
        if kind == "f32" and rows <= DECODE_MATMUL_MAX_ROWS:
            return [arrays[0]], 0, 0
        if kind == "q" and rows <= DECODE_QUANTIZED_MAX_ROWS and dtype == mx.float32:
            return list(arrays[:3]), arrays[4], arrays[3]
        return None

    def _stack(self, modules: list) -> tuple[str | None, tuple]:
        weights = [_float32_weight(m) for m in modules]
        if self.matmul_kernel is not None and all(w is not None for w in weights):
            if len(modules) == 1:
                return "f32", (weights[0],)
            return "f32", (_stack_rows(modules, ["weight"])[0],)
        quantized = [quantized_weight(m) for m in modules]
        if (self.quantized_kernel is not None and all(q is not None for q in quantized)
                and len({(q[3], q[4], q[1].dtype) for q in quantized}) == 1):
            if len(modules) == 1:
                return "q", quantized[0]
            w, scales, biases = _stack_rows(modules, ["weight", "scales", "biases"])
            return "q", (w, scales, biases, quantized[0][3], quantized[0][4])
        return None, ()

    def decoder_layer(self, step: Step, i: int, layer, x: mx.array, qk_norm: bool,
                      rope: bool) -> mx.array | None:
        """Layer i of a llama-style block as one native op (engine/native/decoder_layer.h):
        norms, q/k/v, RoPE, the KV write, paged attention, o, SwiGLU MLP and residuals. None
        where any part would take another path than its native op on this step, so the op
        gives exactly the bits of the op-by-op layer (tests/engine/test_decoder_layer.py)."""
        op = self.layer_kernel
        if op is None or self.path != "gemm" or x.dtype != mx.float32:
            return None
        key = (i, qk_norm, rope)
        entry = self._layer_ops.get(key)
        if entry is None or entry[0] is not layer:  # kept with its module: ids are not reused
            entry = self._layer_ops[key] = (layer, self._layer_op(i, layer, qk_norm, rope))
        found = entry[1]
        if found is None or x.shape[1] > found[0]:
            return None
        head, tail = found[1], found[2]
        kv = self.layer_kv[i]
        plan = step.plan(kv.window)
        pool = self.pool
        # The op writes the rows' keys and values into these arrays when it is evaluated
        # (decoder_layer.h): the step's output depends on it, and _forward evaluates that.
        k_pool, v_pool = pool.writable(kv.pool_layer, x.dtype)
        return op(x[0], *head, k_pool, v_pool, step.write, step.pos, *tail, plan.tables,
                  plan.lens, plan.query_lens, *found[3:], plan.window or 0)[None]

    def _layer_op(self, i: int, layer, qk_norm: bool, rope: bool) -> tuple | None:
        """What the fused op takes for layer i that does not change from step to step:
        (most rows, arguments before the pool, RoPE arguments, attention scale and block
        size), or None where a part of the layer has no native op."""
        kv = self.layer_kv[i]
        if not kv.writes or self.attention_kernel is None:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        qk_norms = [attn.q_norm, attn.k_norm] if qk_norm else []
        if (any(type(n) is not nn.RMSNorm or n.weight.dtype != mx.float32
                for n in norms + qk_norms)
                or norms[0].eps != norms[1].eps
                or (qk_norm and qk_norms[0].eps != qk_norms[1].eps)
                or any(getattr(m, "bias", None) is not None
                       for m in (attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj))):
            return None
        qkv_modules = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv_bias = [getattr(m, "bias", None) for m in qkv_modules]
        if all(b is None for b in qkv_bias):
            qkv_bias = []
        elif any(b is None or b.dtype != mx.float32 for b in qkv_bias):
            return None
        linears = [self._native_weights(modules, 1, mx.float32) for modules in
                   (qkv_modules, [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj])]
        if any(found is None for found in linears):
            return None
        # Float32 layers take the native kernel on steps of few rows only.
        max_rows = min(DECODE_MATMUL_MAX_ROWS if bits == 0 else DECODE_QUANTIZED_MAX_ROWS
                       for _, bits, _ in linears)
        tail = (None, 0, False, 1.0)  # inv_freqs, dims, traditional, scale: no RoPE
        if rope:
            freqs = self.rope_freqs(attn.rope)
            if freqs is None:
                return None
            tail = (freqs[0], attn.rope.dims, attn.rope.traditional, freqs[1])
        head = (norms[0].weight, norms[1].weight, norms[0].eps, *linears, qkv_bias,
                [n.weight for n in qk_norms], qk_norms[0].eps if qk_norm else 0.0,
                attn.n_heads, attn.n_kv_heads, _head_dim(attn))
        return max_rows, head, tail, attn.scale, self.pool.block_size

    def norm(self, module, x: mx.array) -> mx.array:
        if (self.row_ops is not None and type(module) is nn.RMSNorm and x.dtype == mx.float32
                and module.weight.dtype == mx.float32):
            return self.row_ops[0](x, module.weight, module.eps)
        return module(x)

    def native_rope(self, rope, q: mx.array, k: mx.array) -> tuple | None:
        """(op, inv_freqs, scale) for the native RoPE of q and k, or None: MLX's. The native op
        takes nn.RoPE and Llama3RoPE (a position-only angle); other variants scale or mix."""
        if self.row_ops is None or q.dtype != mx.float32 or k.dtype != mx.float32:
            return None
        found = self.rope_freqs(rope)
        return None if found is None else (self.row_ops[1], *found)

    def rope_freqs(self, rope) -> tuple[mx.array, float] | None:
        """(inv_freqs, position scale) of a RoPE module the native ops rotate by, or None."""
        entry = self._rope_freqs.get(id(rope))
        if entry is None or entry[0] is not rope:  # kept with its module: an id is not reused
            entry = self._rope_freqs[id(rope)] = (rope, _rope_freqs(rope))
        return entry[1]

    def run(self, groups: list[RowGroup], path: str = "gemm") -> StepOutput:
        """One forward over the groups' rows, every linear layer along `path`."""
        t0 = time.perf_counter()
        self.path = path
        step = Step(self, groups)
        logits_rows, sampled = self._forward(step, groups)
        samples = self._sample(logits_rows, sampled) if sampled else {}
        traces = self._traces(groups, logits_rows, sampled) if any(g.trace for g in groups) else {}
        return StepOutput(samples=samples, model_time=time.perf_counter() - t0, traces=traces,
                          expert_rows=step.expert_rows())

    def _traces(self, groups, logits_rows, sampled) -> dict[str, StepTrace]:
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
            slots = mx.array(_slots(g.block_table, g.start + g.num_rows, bs)[g.start:])
            layers = []
            for layer in range(self.pool.num_layers):
                kv = mx.stack(self.pool.read(layer, slots))  # (2, kv_heads, rows, head_dim)
                pad = [(0, 0), (0, heads - kv.shape[1]), (0, 0), (0, dim - kv.shape[3])]
                layers.append(mx.pad(kv, pad) if kv.shape[1] != heads or kv.shape[3] != dim
                              else kv)
            kv = mx.stack(layers)
            logits = None
            if g.sample:
                at = sum(s.sampled_rows for s in sampled[:sampled.index(g)])
                rows = logits_rows[at:at + g.sampled_rows].astype(mx.float32)
                logits = np.array(rows if g.verify else rows[0])
            out[g.seq_id] = StepTrace(np.array(kv.astype(mx.float32)), logits)
        return out

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, step: Step,
                 groups: list[RowGroup]) -> tuple[mx.array | None, list[RowGroup]]:
        family = self.family
        x = family.embed(step, step.tokens)  # (1, rows, hidden)
        for i in range(len(self.layer_kv)):
            x = family.layer(step, i, x)

        sampled = [g for g in groups if g.sample]
        if not sampled:
            # x too: a fused layer (decoder_layer) writes the pool when its output is evaluated.
            mx.eval(x, self.pool.state())
            return None, []
        rows, r = [], 0
        for g in groups:
            r += g.num_rows
            rows.extend(range(r - g.sampled_rows, r))
        logits = family.head(step, x[:, mx.array(rows)])  # (1, sampled rows, vocab)
        return logits[0], sampled

    # ---- sampling ----------------------------------------------------------------------------
    def _sample(self, logits: mx.array, groups: list[RowGroup]) -> dict[str, list[Sample]]:
        # Same arithmetic as mlx-lm's generate: log-softmax in the model's dtype, then argmax.
        if self.row_ops is not None and logits.dtype == mx.float32:
            logprobs = logits - self.row_ops[2](logits)[:, None]  # mx.logsumexp's bits, faster
        else:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        # Per sampled row: the target's choice there. A sampling verify group also gets, per
        # draft, the target's probability of it and a uniform draw (speculative sampling).
        checks = []
        if all(g.params is None or g.params.greedy for g in groups):
            token_ids = greedy  # the usual step: no per-row graph at all
        else:
            chosen, at = [], 0
            for g in groups:
                p, n = g.params, g.sampled_rows
                if p is None or p.greedy:
                    chosen.append(greedy[at:at + n])
                else:
                    for j, d in enumerate(g.token_ids[1:] if g.verify else []):
                        accept_prob, u, residual = _verify_row(logprobs[at + j], p,
                                                               g.output_index + j, d)
                        chosen.append(residual[None])
                        checks.append(mx.stack([accept_prob, u]))
                    chosen.append(_sample_row(logprobs[at + n - 1], p,
                                              g.output_index + n - 1)[None])
                at += n
            token_ids = mx.concatenate(chosen)
        token_lp = mx.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        draft_lp = token_lp
        if any(g.verify for g in groups):
            # Row j of a verify group emits draft j + 1 if it is accepted: its logprob there.
            drafts = []
            for g in groups:
                drafts += g.token_ids[1:] if g.verify else []
                drafts.append(0)  # the group's last row: never a draft's
            draft_lp = mx.take_along_axis(logprobs, mx.array(drafts)[:, None], axis=-1)[:, 0]
        checks = mx.stack(checks) if checks else None
        k = max((g.params.logprobs if g.params else 0) for g in groups)
        top_ids = top_lp = None
        wanted = [token_ids, token_lp, draft_lp, self.pool.state()]
        if k:
            top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
            wanted += [top_ids, top_lp]
        mx.eval(*wanted, *([checks] if checks is not None else []))
        ids_list = token_ids.tolist()
        lp_list = token_lp.astype(mx.float32).tolist()
        draft_lp_list = draft_lp.astype(mx.float32).tolist()
        checks_list = checks.astype(mx.float32).tolist() if checks is not None else []
        top_ids_l = top_ids.tolist() if k else None
        top_lp_l = top_lp.astype(mx.float32).tolist() if k else None

        def top(row: int, want: int) -> list[tuple[int, float]]:
            if not want:
                return []
            pairs = sorted(zip(top_ids_l[row], top_lp_l[row], strict=True), key=lambda t: -t[1])
            return pairs[:want]

        out, at, check = {}, 0, 0
        for g in groups:
            want = g.params.logprobs if g.params else 0
            drafts = g.token_ids[1:] if g.verify else []
            if g.params is None or g.params.greedy:
                accepted = accepted_prefix(drafts, ids_list[at:at + len(drafts)])
            else:
                accepted = next((j for j, (prob, u) in
                                 enumerate(checks_list[check:check + len(drafts)])
                                 if u >= prob), len(drafts))
                check += len(drafts)
            emitted = [Sample(drafts[j], draft_lp_list[at + j], top(at + j, want), drafted=True)
                       for j in range(accepted)]
            last = at + accepted
            emitted.append(Sample(ids_list[last], lp_list[last], top(last, want)))
            out[g.seq_id] = emitted
            at += g.sampled_rows
        return out


def _attention_kernel(attention: str, fused: bool):
    """The native attention op to use, or None for MLX ops (see engine/attention.py)."""
    return _native_op("attention", attention, fused, native.paged_attention)


def _matmul_kernel(decode_matmul: str, fused: bool):
    """The native decode linear op to use, or None for MLX's matmul."""
    return _native_op("decode_matmul", decode_matmul, fused, native.decode_linear)


def _quantized_kernel(decode_matmul: str, fused: bool):
    """The native quantized decode linear op to use (the same setting), or None for MLX's:
    "auto" takes it only where it runs a vector path (native.decode_quantized_fast)."""
    if decode_matmul == "auto" and not fused and not native.decode_quantized_fast():
        return None
    return _native_op("decode_matmul", decode_matmul, fused, native.decode_quantized_linear)


def _row_ops(decode_matmul: str, fused: bool):
    """The native (rms_norm_rows, rope_rows, logsumexp_rows), or None for MLX's ops (a GPU,
    or "mlx")."""
    return _native_op("decode_matmul", decode_matmul, fused, native.row_ops)


def _layer_kernel(decode_matmul: str, fused: bool):
    """The native decoder layer op (the same setting as the row ops), or None."""
    return _native_op("decode_matmul", decode_matmul, fused, native.decoder_layer)


def _rope_freqs(rope) -> tuple[mx.array, float] | None:
    """(inv_freqs, position scale) as mlx.core.fast.rope computes them for this module."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    if type(rope) is nn.RoPE:
        half = rope.dims // 2
        inv = mx.exp(mx.arange(0.0, -half, -1.0) * (math.log(rope.base) / half))
        scale = rope.scale
    elif type(rope) is Llama3RoPE:
        inv, scale = mx.reciprocal(rope._freqs), 1.0
    else:
        return None
    inv = inv.astype(mx.float32)
    mx.eval(inv)
    return inv, float(scale)


def _native_op(setting: str, value: str, fused: bool, get):
    """engine.config.NATIVE_SETTING: on a GPU backend (fused attention) "auto" is MLX's own
    kernels and "native" an error; on the CPU, "native" is an error when the op is not built."""
    check_native_setting(setting, value)
    if value == "mlx" or (value == "auto" and fused):
        return None
    if fused:
        raise ValueError(f"{setting} 'native' runs on the CPU backend only")
    op = get()
    if op is None and value == "native":
        raise ValueError(f"{setting} 'native': the kernel is {native.why_not()}")
    return op


def _float32_weight(module, kind=nn.Linear) -> mx.array | None:
    """The weight the native kernel can take: an unquantized float32 one (quantized layers
    are other classes, and bfloat16/float16 ones keep MLX's matmul)."""
    if type(module) is not kind or module.weight.dtype != mx.float32:
        return None
    return module.weight


def quantized_weight(module, kind=nn.QuantizedLinear) -> tuple | None:
    """(weight, scales, biases, group_size, bits) the native quantized kernel can take: MLX's
    affine quantization at 4 or 8 bits in groups of 32, 64 or 128; None for anything else."""
    if (type(module) is not kind or getattr(module, "mode", "affine") != "affine"
            or module.bits not in (4, 8) or module.group_size not in (32, 64, 128)
            or getattr(module, "biases", None) is None):
        return None
    return module.weight, module.scales, module.biases, module.group_size, module.bits


def _stack_rows(modules: list, names: list[str]) -> list[mx.array]:
    """Concatenate the modules' parameters `names` along the output axis, and make each
    module's own parameter a view of its rows of the result (evaluated: no copy is kept)."""
    stacked = [mx.concatenate([m[name] for m in modules], axis=0) for name in names]
    mx.eval(stacked)
    at = 0
    for m in modules:
        n = m["weight"].shape[0]
        for name, whole in zip(names, stacked, strict=True):
            m[name] = whole[at:at + n]
        at += n
    mx.eval([m[name] for m in modules for name in names])
    return stacked


def _target_scores(logprobs: mx.array, p: SamplingParams) -> mx.array:
    """(1, vocab) scores whose softmax is the distribution a request samples from: top-p and
    top-k cuts, then temperature."""
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    x = logprobs[None]
    if 0.0 < p.top_p < 1.0:
        x = apply_top_p(x, p.top_p)
    if 0 < p.top_k < x.shape[-1]:
        x = apply_top_k(x, p.top_k)
    return x * (1.0 / p.temperature)


def _key(p: SamplingParams, output_index: int) -> mx.array | None:
    # A key per (seed, token index): the same request samples the same tokens whatever
    # shares its batch, and a preempted request resumes on the same random stream.
    if p.seed is None:
        return None
    return mx.random.key((p.seed * 1_000_003 + output_index) % (2**63))


def _sample_row(logprobs: mx.array, p: SamplingParams, output_index: int) -> mx.array:
    return mx.random.categorical(_target_scores(logprobs, p), key=_key(p, output_index))[0]


def _verify_row(logprobs: mx.array, p: SamplingParams, output_index: int,
                draft: int) -> tuple[mx.array, mx.array, mx.array]:
    """Speculative sampling of one drafted token (a point proposal, as prompt lookup makes):
    accept it when u < p(draft), otherwise emit a sample of p with the draft taken out. Each
    emitted token is then distributed exactly as p (tests/engine/test_speculative.py).
    Returns (p(draft), u, the residual sample)."""
    scores = _target_scores(logprobs, p)[0]
    probs = mx.softmax(scores, axis=-1)
    key = _key(p, output_index)
    accept_key, residual_key = mx.random.split(key) if key is not None else (None, None)
    u = mx.random.uniform(key=accept_key)
    residual = mx.where(mx.arange(scores.shape[-1]) == draft, NEG_INF, scores)
    return probs[draft], u, mx.random.categorical(residual, key=residual_key)


def _slots(block_table: list[int], num_tokens: int, block_size: int) -> np.ndarray:
    """Pool slots of positions [0, num_tokens) of a sequence with this block table."""
    n_blocks = -(-num_tokens // block_size)
    table = np.asarray(block_table[:n_blocks], dtype=np.int64)
    return (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]
