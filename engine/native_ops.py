"""The native ops (engine/native/) as a runner uses them: which kernel each setting picks, the
weights each kernel takes, and the linear layers, norms, RoPE and fused decoder layer that run
on them (or on MLX's own ops where a kernel does not apply: the same call, MLX's bits).

The model loader asks the same rule of a layer (`quantized_weight`) that the runner follows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from engine import collectives, native
from engine.attention import use_fused_attention
from engine.config import (
    DEFAULT_TILE,
    KernelPath,
    NativeSetting,
    check_activations,
    check_native_setting,
)
from engine.kernels import PathTally, apply_linear

# Up to this many rows a "gemm" step's float32 linear layers go to the native kernel: it is
# faster than MLX's BLAS matmul at every row count measured in
# benchmarks/results/decode_linear.md (benchmarks/decode_linear.py), the less so the more rows.
# A "tiled" step's calls take at most this many rows (NativeOps.linear).
DECODE_MATMUL_MAX_ROWS = 32
# The same for MLX's affine-quantized layers (the shipped 4-bit linears and 8-bit tied head):
# the native quantized kernel. On the CPU MLX's quantized_matmul computes one row at a time,
# and the kernel is faster at every row count measured over the whole model, the more so the
# more rows (benchmarks/results/decode_quantized.md, from benchmarks/decode_linear.py --weights
# q4; `--rows 512 2048` measures larger steps). Since MLX's cost grows with every row, every gemm
# step up to this many rows takes it, and a row gets the same bits in every such step.
DECODE_QUANTIZED_MAX_ROWS = 4096
# The hidden-state dtypes the native norm and the fused layer take: float32, and the half types
# they widen to it exactly (a quantized embedding's output is float16 where its scales are).
WIDENS_EXACTLY = (mx.float32, mx.float16, mx.bfloat16)
# MLX's row-sharded linear layers (tensor parallelism, engine/distributed/shard.py): each rank
# holds a slice of the input features. `linear` runs the native kernel on the slice, then
# all_sum over the ranks, then the bias, as the layer's own forward does.
ROW_SHARDED = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)


def _row_slice(module, x: mx.array) -> mx.array:
    """A row-sharded layer's product on this rank's slice, as its own forward computes it
    before the all_sum (mlx.nn.layers.distributed)."""
    if "scales" not in module:
        return x @ module["weight"].T
    return mx.quantized_matmul(x, module["weight"], scales=module["scales"],
                               biases=module.get("biases"), transpose=True,
                               group_size=module.group_size, bits=module.bits, mode=module.mode)


@dataclass(frozen=True, eq=False)
class FusedLayer:
    """A llama-style pre-norm block as the native fused decoder layer computes it:
    x + o(attention(rope(q_norm(q)), rope(k_norm(k)), v)) over input_norm(x), then
    + down(silu(gate) * up) over post_attention_norm(x). The family names its modules
    (Family.fused_layer_spec); NativeOps.fused_layer makes the op's spec of it."""

    input_norm: nn.Module
    post_attention_norm: nn.Module
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    q_norm: nn.Module | None = None  # per-head RMSNorms before RoPE (both or neither)
    k_norm: nn.Module | None = None
    rope: nn.Module | None = None  # None: a layer without RoPE


@dataclass(frozen=True)
class NativeLayer:
    """A layer as the fused op takes it, made once per layer (NativeOps.fused_layer)."""

    spec: object  # engine.native's LayerSpec: the layer's weights and shape, checked
    max_rows: int  # the most rows a step may have for every part to take its native kernel


class NativeOps:
    """The native kernels a model runs on, chosen once from the settings (None: MLX's op),
    and the operations that use them. A step passes its kernel path and tile."""

    def __init__(self, model, attention: str = NativeSetting.AUTO,
                 row_kernels: str = NativeSetting.AUTO, stacks: dict | None = None,
                 activations: str = "float32"):
        """stacks: another NativeOps' `stacks` over the same modules (a draft made of the
        target's layers), shared instead of stacked again. activations: "int8" runs the
        affine-quantized layers on 8-bit activations (engine.config.ACTIVATIONS)."""
        self.model = model
        self.fused_attention = use_fused_attention()
        self.attention_kernel = attention_kernel(attention, self.fused_attention)
        self.matmul_kernel = matmul_kernel(row_kernels, self.fused_attention)
        self.quantized_kernel = quantized_kernel(row_kernels, self.fused_attention)
        check_activations(activations)
        self.int8_activations = activations == "int8"
        if self.int8_activations:
            self.quantized_kernel = self._int8_kernel()
        # RMS norm, RoPE and the sampler's logsumexp as one native op each
        # (engine/native/row_ops.h), with the native linear kernels: "mlx" keeps MLX's own ops
        # for all of a row's math.
        self.row_ops = _row_ops(row_kernels, self.fused_attention)
        # A step's tokens through an affine-quantized embedding, and greedy sampling's token
        # and logprob, one op each (the same setting).
        self.embedding_kernel = _native_op("row_kernels", row_kernels, self.fused_attention,
                                           native.quantized_embedding)
        self.greedy_kernel = _native_op("row_kernels", row_kernels, self.fused_attention,
                                        native.greedy)
        # Consecutive llama-style layers as one op where all of their parts take the native
        # ops above (native.decoder_layers).
        self.layer_kernel = _layer_kernel(row_kernels, self.fused_attention)
        self._rope_freqs: dict[int, tuple] = {}  # id(rope) -> (rope, _rope_freqs(rope))
        self._stacks: dict[tuple, tuple] = {} if stacks is None else stacks

    @property
    def stacks(self) -> dict[tuple, tuple]:
        """The native kernels' weights made so far: the stacked q/k/v and gate/up weights
        (ids of the modules -> (modules, kind, arrays); quantized layers' own weights are
        views of them), and the float32 kernel's packed copies of single weights (("packed",
        id(weight)) -> (weight, packed))."""
        return self._stacks

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

    def _int8_kernel(self):
        """The native quantized op with its int8-activation option on; an error naming why
        where nothing would take it (the option would be silently off)."""
        if self.quantized_kernel is None:
            why = native.why_not() or "not used with row_kernels 'mlx' or on a GPU backend"
            raise ValueError("activations 'int8' runs on the native quantized kernel, which "
                             f"this engine does not use (the native kernels: {why})")
        if not self.native_quantized_applies:
            raise ValueError("activations 'int8' applies to affine 4/8-bit weights, and this "
                             "model has none (--weights q4 quantizes it)")
        return partial(self.quantized_kernel, int8_activations=True)

    def describe_attention(self, setting: str) -> str:
        """Which attention a step's rows use under this setting, in words."""
        if self.attention_kernel is not None:
            return "native paged kernel"
        if self.fused_attention:
            return "MLX fused attention per sequence"
        why = native.why_not() if setting == NativeSetting.AUTO else None
        return "MLX ops per sequence" + (f" (native kernel {why})" if why else "")

    def describe_row_kernels(self, setting: str, weights: str) -> str:
        """Which kernels the linear layers of gemm steps (and with them a row's other math)
        run on under the row_kernels setting, in words (weights: the model's format, named
        where no kernel takes it)."""
        if self.quantized_kernel is not None and self.native_quantized_applies:
            return (f"native quantized kernel up to {DECODE_QUANTIZED_MAX_ROWS} rows "
                    f"({native.decode_quantized_isa()} path; each row computed alone, so "
                    "every step is batch-invariant: kernel path native where every matmul "
                    "takes it)")
        if self.matmul_kernel is not None:
            if self.native_matmul_applies:
                return (f"native kernel up to {DECODE_MATMUL_MAX_ROWS} rows (each row computed "
                        "alone: batch-invariant up to there, kernel path native; larger steps "
                        "take the BLAS, kernel path gemm, unless --batch-invariant; it reads a "
                        "packed copy of each float32 weight: their memory twice)")
            return (f"MLX (the native kernels take float32 or affine 4/8-bit, weights are "
                    f"{weights})")
        if self.fused_attention:  # a GPU: the kernel each call takes is MLX's choice
            return "MLX (each call's kernel chosen by MLX)"
        why = native.why_not() if setting == NativeSetting.AUTO else None
        return "MLX" + (f" (native kernel {why})" if why else "")

    # The one place a linear layer runs: the step's kernel path decides how.
    # - "gemm": a layer that has a native kernel (float32, or affine 4/8-bit on float32
    #   activations) takes it on a step of up to the kernel's row limit (_row_limit), one
    #   call; above it, MLX's batched call.
    # - "tiled" (--batch-invariant): such a layer takes its native kernel on every step, in
    #   calls of at most that limit. The kernels compute each row alone, in an order set by the
    #   weights' shape only (engine/native/decode_linear.cpp, decode_quantized.cpp), so a row
    #   gets the same bits in a call of any size: the step's rows may be cut anywhere. Only a
    #   layer without one goes through MLX, in calls of exactly `tile` rows (engine/kernels.py).
    #   The choice depends on the layer and dtype alone, never on the step's rows.
    # - "gemv": MLX's call per row.
    # `tally` (the step's PathTally) is told which path each call took.
    def linear(self, module, x: mx.array, tied: bool = False, path: str = KernelPath.GEMM,
               tile: int = DEFAULT_TILE, tally: PathTally | None = None) -> mx.array:
        """A linear layer on x (1, rows, features); tied=True: an embedding as the head."""
        found = self._native_linear(module, tied, x.dtype) if path != KernelPath.GEMV else None
        kernel = found is not None and (path == KernelPath.TILED or x.shape[1] <= found[1])
        if type(module) in ROW_SHARDED:  # its slice here, then the sum over the ranks
            out = (_in_row_chunks(found[0], x, found[1], tally) if kernel
                   else apply_linear(lambda v: _row_slice(module, v), x, path, tile, tally))
            out = collectives.all_sum(out, module.group)
        elif kernel:
            out = _in_row_chunks(found[0], x, found[1], tally)
        else:
            return apply_linear(module.as_linear if tied else module, x, path, tile, tally)
        bias = getattr(module, "bias", None)
        return out if bias is None else out + bias

    def _native_linear(self, module, tied: bool, dtype: mx.Dtype) -> tuple | None:
        """(the native kernel that takes this layer, as a function of x; its row limit), or
        None where MLX computes the layer."""
        plain, quantized = ((nn.Embedding, nn.QuantizedEmbedding) if tied
                            else (nn.Linear, nn.QuantizedLinear))
        if type(module) in ROW_SHARDED:  # the kernel on its slice (`linear` sums the ranks)
            plain = quantized = type(module)
        if self.matmul_kernel is not None:
            weight = _float32_weight(module, plain)
            if weight is not None:
                packed, n = self._packed_weight(weight), weight.shape[0]
                return (lambda v: self.matmul_kernel(v, packed, n)), DECODE_MATMUL_MAX_ROWS
        if self.quantized_kernel is not None and dtype == mx.float32:
            q = quantized_weight(module, quantized)
            if q is not None:
                return (lambda v: self.quantized_kernel(v, *q)), DECODE_QUANTIZED_MAX_ROWS
        return None

    def linears(self, modules: list, x: mx.array, path: str = KernelPath.GEMM,
                tile: int = DEFAULT_TILE, tally: PathTally | None = None) -> list[mx.array]:
        """Linear layers that share an input. Where the native kernels take them on this step
        (as in `linear`), they take them as one call over their weights stacked by output
        (`stacks`): each output's arithmetic in those kernels depends on its own weights alone,
        so the bits are those of one call per layer, with a fraction of the calls."""
        stacked = self._stacked(modules, x, path, tally) if path != KernelPath.GEMV else None
        if stacked is None:
            return [self.linear(m, x, path=path, tile=tile, tally=tally) for m in modules]
        out = stacked(x)
        parts, at = [], 0
        for m in modules:
            n = m.weight.shape[0]
            part = out[..., at:at + n]
            at += n
            bias = getattr(m, "bias", None)
            parts.append(part if bias is None else part + bias)
        return parts

    def _stacked(self, modules: list, x: mx.array, path: str, tally: PathTally | None):
        """The native call for `modules` on x (a function of x, in calls of at most the
        kernel's row limit), or None where a layer would not take a native kernel on this
        step's path and rows."""
        found = self._native_weights(modules, x.dtype)
        if found is None:
            return None
        arrays, bits, group_size = found
        most = _row_limit(bits)
        if path == KernelPath.GEMM and x.shape[1] > most:
            return None
        outputs = sum(m["weight"].shape[0] for m in modules)
        kernel = ((lambda c: self.matmul_kernel(c, arrays[0], outputs)) if bits == 0 else
                  (lambda c: self.quantized_kernel(c, *arrays, group_size, bits)))
        return lambda v: _in_row_chunks(kernel, v, most, tally)

    def _native_weights(self, modules: list, dtype: mx.Dtype) -> tuple[list, int, int] | None:
        """(arrays, bits, group_size) of the native kernel that takes `modules` stacked by
        output on activations of `dtype`: ([packed weight], 0, 0) for float32, ([w, scales,
        biases], bits, group_size) for affine-quantized; None where none would. They are made
        on first use. Quantized layers' own weights become views of the stacked ones, so no
        memory is added (a single layer is taken as it is); float32 layers keep theirs, and
        the kernel's packed copy is added (`_packed_weight`)."""
        key = tuple(id(m) for m in modules)
        entry = self._stacks.get(key)
        if entry is None or any(a is not b for a, b in zip(entry[0], modules, strict=True)):
            entry = self._stacks[key] = (modules, *self._stack(modules))  # modules kept alive
        _, kind, arrays = entry
        if kind == "f32":
            return [arrays[0]], 0, 0
        if kind == "q" and dtype == mx.float32:
            return list(arrays[:3]), arrays[4], arrays[3]
        return None

    def _stack(self, modules: list) -> tuple[str | None, tuple]:
        weights = [_float32_weight(m) for m in modules]
        if self.matmul_kernel is not None and all(w is not None for w in weights):
            if len(modules) == 1:
                return "f32", (self._packed_weight(weights[0]),)
            return "f32", (_packed(mx.concatenate(weights, axis=0)),)
        quantized = [quantized_weight(m) for m in modules]
        if (self.quantized_kernel is not None and all(q is not None for q in quantized)
                and len({(q[3], q[4], q[1].dtype) for q in quantized}) == 1):
            if len(modules) == 1:
                return "q", quantized[0]
            w, scales, biases = _stack_rows(modules, ["weight", "scales", "biases"])
            return "q", (w, scales, biases, quantized[0][3], quantized[0][4])
        return None, ()

    def _packed_weight(self, weight: mx.array) -> mx.array:
        """The float32 kernel's packed copy of `weight` (native.pack_linear_weight), made on
        its first native call and kept."""
        key = ("packed", id(weight))
        entry = self._stacks.get(key)
        if entry is None or entry[0] is not weight:  # weight kept alive: its id stays its own
            entry = self._stacks[key] = (weight, _packed(weight))
        return entry[1]

    def embed(self, module, tokens: mx.array) -> mx.array:
        """An embedding module on a step's tokens (rows,): (1, rows, dims). MLX's
        affine-quantized embedding at 4 or 8 bits is one native op with its bits (MLX's CPU
        dequantize builds ~40 ops for it: more to schedule each step than to compute); any
        other embedding is the module's own call."""
        found = (None if self.embedding_kernel is None
                 else quantized_weight(module, nn.QuantizedEmbedding))
        if found is None:
            return module(tokens[None])
        weight, scales, biases, group_size, bits = found
        return self.embedding_kernel(weight, scales, biases, tokens, group_size=group_size,
                                     bits=bits)[None]

    def norm(self, module, x: mx.array) -> mx.array:
        """An RMS norm module (mlx-lm's nn.RMSNorm) on x: the native op where it applies."""
        if (self.row_ops is not None and type(module) is nn.RMSNorm
                and x.dtype in WIDENS_EXACTLY and module.weight.dtype == mx.float32):
            # A half x widens exactly, and with a float32 weight MLX's norm computes on the
            # widened values too (a float32 result), so the op takes it widened.
            return self.row_ops[0](x.astype(mx.float32), module.weight, module.eps)
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

    def logsumexp(self, logits: mx.array) -> mx.array:
        """(rows, 1) logsumexp of (rows, vocab) logits: on float32 the native op, whose bits
        are mx.logsumexp's, faster."""
        if self.row_ops is not None and logits.dtype == mx.float32:
            return self.row_ops[2](logits)[:, None]
        return mx.logsumexp(logits, axis=-1, keepdims=True)

    def greedy(self, logits: mx.array) -> tuple[mx.array, mx.array] | None:
        """Greedy sampling of (rows, vocab) float32 logits as one native op: (each row's
        token, uint32; its logprob), the bits of the sampler's own ops (engine/sampler.py's
        draw, which asks); None where the op does not apply."""
        if self.greedy_kernel is None or logits.dtype != mx.float32:
            return None
        return tuple(self.greedy_kernel(logits))

    def fused_layer(self, spec: FusedLayer, block_size: int, window: int) -> NativeLayer | None:
        """The fused op's spec of a layer (native.layer_spec(), every field named and checked
        once, here), or None where a part of the layer has no native op. block_size: the
        pool's; window: the layer's sliding window (0: none)."""
        layer_spec = native.layer_spec()
        if (self.attention_kernel is None or layer_spec is None
                or type(spec.o) in ROW_SHARDED or type(spec.down) in ROW_SHARDED):
            return None  # (the fused op has no all_sum inside: a sharded layer goes op by op)
        norms = [spec.input_norm, spec.post_attention_norm]
        qk_norms = [spec.q_norm, spec.k_norm] if spec.q_norm is not None else []
        if (any(type(n) is not nn.RMSNorm or n.weight.dtype != mx.float32
                for n in norms + qk_norms)
                or norms[0].eps != norms[1].eps
                or (qk_norms and qk_norms[0].eps != qk_norms[1].eps)
                or any(getattr(m, "bias", None) is not None
                       for m in (spec.o, spec.gate, spec.up, spec.down))):
            return None
        qkv_modules = [spec.q, spec.k, spec.v]
        qkv_bias = [getattr(m, "bias", None) for m in qkv_modules]
        if all(b is None for b in qkv_bias):
            qkv_bias = [None] * 3
        elif any(b is None or b.dtype != mx.float32 for b in qkv_bias):
            return None
        linears = [self._native_weights(modules, mx.float32) for modules in
                   (qkv_modules, [spec.o], [spec.gate, spec.up], [spec.down])]
        if any(found is None for found in linears):
            return None
        # Float32 layers take the native kernel on steps of few rows only.
        max_rows = min(_row_limit(bits) for _, bits, _ in linears)
        rope = None
        if spec.rope is not None:
            freqs = self.rope_freqs(spec.rope)
            if freqs is None:
                return None
            rope = layer_spec.Rope(inv_freqs=freqs[0], dims=spec.rope.dims,
                                   traditional=spec.rope.traditional, scale=freqs[1])
        qkv, o, gate_up, down = (_linear_spec(layer_spec.Linear, *found, self.int8_activations)
                                 for found in linears)
        q_bias, k_bias, v_bias = qkv_bias
        q_norm, k_norm = (n.weight for n in qk_norms) if qk_norms else (None, None)
        return NativeLayer(layer_spec(
            attn_norm=norms[0].weight, mlp_norm=norms[1].weight, norm_eps=norms[0].eps,
            qkv=qkv, o=o, gate_up=gate_up, down=down,
            q_bias=q_bias, k_bias=k_bias, v_bias=v_bias,
            q_norm=q_norm, k_norm=k_norm, qk_norm_eps=qk_norms[0].eps if qk_norms else 0.0,
            heads=spec.n_heads, kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, rope=rope,
            attn_scale=spec.scale, block_size=block_size, window=window), max_rows)


def attention_kernel(attention: str, fused: bool):
    """The native attention op to use, or None for MLX ops (see engine/attention.py)."""
    return _native_op("attention", attention, fused, native.paged_attention)


def pool_copy_kernel(attention: str, fused: bool):
    """The native op that copies KV pool rows in place (KVPool.copy_rows), or None for MLX's
    gather and scatter: it follows the attention setting, whose kernel reads those pools."""
    return _native_op("attention", attention, fused, native.pool_copy)


def recurrence_kernel(attention: str, fused: bool):
    """The native Gated DeltaNet recurrence op (engine/recurrence.py; float32 layers) to use,
    or None for MLX ops: it follows the attention setting, as a GDN layer's token mixer."""
    return _native_op("attention", attention, fused, native.gated_delta_rows)


def matmul_kernel(row_kernels: str, fused: bool):
    """The native float32 linear op to use, or None for MLX's matmul."""
    return _native_op("row_kernels", row_kernels, fused, native.decode_linear)


def quantized_kernel(row_kernels: str, fused: bool):
    """The native quantized decode linear op to use (the same setting), or None for MLX's:
    "auto" takes it only where it runs a vector path (native.decode_quantized_fast)."""
    if row_kernels == NativeSetting.AUTO and not fused and not native.decode_quantized_fast():
        return None
    return _native_op("row_kernels", row_kernels, fused, native.decode_quantized_linear)


def _row_ops(row_kernels: str, fused: bool):
    """The native (rms_norm_rows, rope_rows, logsumexp_rows), or None for MLX's ops (a GPU,
    or "mlx")."""
    return _native_op("row_kernels", row_kernels, fused, native.row_ops)


def _layer_kernel(row_kernels: str, fused: bool):
    """The native op of consecutive decoder layers (the same setting as the row ops), or
    None."""
    return _native_op("row_kernels", row_kernels, fused, native.decoder_layers)


def _native_op(setting: str, value: str, fused: bool, get):
    """engine.config.NATIVE_SETTING: on a GPU backend (fused attention) "auto" is MLX's own
    kernels and "native" an error; on the CPU, "native" is an error when the op is not built."""
    check_native_setting(setting, value)
    if value == NativeSetting.MLX or (value == NativeSetting.AUTO and fused):
        return None
    if fused:
        raise ValueError(f"{setting} 'native' runs on the CPU backend only")
    op = get()
    if op is None and value == NativeSetting.NATIVE:
        raise ValueError(f"{setting} 'native': the kernel is {native.why_not()}")
    return op


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


def _packed(weight: mx.array) -> mx.array:
    """weight (out, in) float32 in the layout the native float32 kernel reads, evaluated."""
    packed = native.pack_linear_weight()(weight)
    mx.eval(packed)
    return packed


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


def _row_limit(bits: int) -> int:
    """The most rows of one native linear call: DECODE_MATMUL_MAX_ROWS for float32 weights
    (bits 0), DECODE_QUANTIZED_MAX_ROWS for affine-quantized ones."""
    return DECODE_MATMUL_MAX_ROWS if bits == 0 else DECODE_QUANTIZED_MAX_ROWS


def _in_row_chunks(kernel, x: mx.array, most: int, tally: PathTally | None) -> mx.array:
    """kernel(x) for x (1, rows, features), in calls of at most `most` rows: the same bits as
    one call for a kernel that computes each row alone (the native linear kernels)."""
    rows = x.shape[1]
    if tally is not None:
        tally.took(KernelPath.NATIVE, -(-rows // most))
    if rows <= most:
        return kernel(x)
    return mx.concatenate([kernel(x[:, i:i + most]) for i in range(0, rows, most)], axis=1)


def _linear_spec(linear: type, arrays: list, bits: int, group_size: int, int8: bool):
    """A LayerSpec.Linear of NativeOps._native_weights' (arrays, bits, group_size); int8: its
    quantized layers on 8-bit activations."""
    if bits == 0:
        return linear(arrays[0])
    weight, scales, biases = arrays
    return linear(weight, scales=scales, biases=biases, bits=bits, group_size=group_size,
                  int8_activations=int8)


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
