"""One engine step on the model: packed rows in, sampled tokens out.

All of a step's token positions (prefill chunks and decode rows) are packed into one
(1, rows, hidden) input, so each linear layer sees exactly the step's rows. Attention is done
per sequence, reading its keys and values from the paged pool through its block table with its
own causal offset (engine/attention.py: the native kernel for decode rows on the CPU, MLX ops
otherwise). mlx-lm's modules provide the weights, norms, RoPE and activation; this file
only routes the data. Logits are computed only for the rows that are sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import native
from engine.attention import attend_step, plan_step, use_fused_attention
from engine.config import check_native_setting
from engine.kernels import apply_linear
from engine.kv_cache import KVPool
from engine.sampling import SamplingParams

NEG_INF = float("-inf")
# Up to this many rows a "gemm" step's float32 linear layers go to the native kernel: in
# benchmarks/decode_linear.py it is faster than MLX's BLAS matmul at every row count up to 32
# (1.2-1.8x here), and the gap closes above.
DECODE_MATMUL_MAX_ROWS = 32


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

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)


@dataclass
class Sample:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives


@dataclass
class StepOutput:
    samples: dict[str, Sample]  # seq_id -> sampled token, for groups with sample=True
    model_time: float  # seconds: forward + sampling, evaluated
    traces: dict[str, StepTrace] = field(default_factory=dict)  # seq_id -> what it wrote


@dataclass
class StepTrace:
    """What one traced sequence's rows produced in a step, copied out of MLX."""

    kv: np.ndarray  # (layers, 2 [keys, values], kv_heads, rows, head_dim), float32
    logits: np.ndarray | None  # (vocab,) float32 at the sampled row, or None (no sample)


class UnsupportedModelError(ValueError):
    pass


class ModelRunner:
    def __init__(self, model, pool: KVPool, decode_attention: str = "auto",
                 decode_matmul: str = "auto"):
        self.model = model
        self.pool = pool
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or not layers:
            raise UnsupportedModelError(
                "model has no .model.layers: not a decoder-only mlx-lm model")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"):
            if not hasattr(layers[0].self_attn, name):
                raise UnsupportedModelError(
                    f"attention layer lacks {name!r}: only llama-style architectures "
                    "(llama, mistral, qwen2, qwen3, ...) are supported")
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not hasattr(layers[0].mlp, name):
                raise UnsupportedModelError(f"MLP lacks {name!r}: not a llama-style SwiGLU MLP")
        self.inner = inner
        self.layers = layers
        self.fused_attention = use_fused_attention()
        self.attention_kernel = _decode_kernel(decode_attention, self.fused_attention)
        self.matmul_kernel = _matmul_kernel(decode_matmul, self.fused_attention)
        self.path = "gemm"
        self.tile = 16  # rows per call on the batch-invariant ("tiled") path

    @property
    def native_matmul_applies(self) -> bool:
        """Whether few-row gemm steps reach the native kernel (float32 linear layers)."""
        return (self.matmul_kernel is not None
                and _float32_weight(self.layers[0].self_attn.q_proj) is not None)

    # The one place a linear layer runs: the step's kernel path decides how. A "gemm" step of
    # few rows takes the native kernel for float32 weights (one call, each row on its own).
    def linear(self, module, x: mx.array, weight: mx.array | None = None) -> mx.array:
        if (self.matmul_kernel is not None and self.path == "gemm"
                and x.shape[1] <= DECODE_MATMUL_MAX_ROWS):
            weight = _float32_weight(module) if weight is None else weight
            if weight is not None:
                out = self.matmul_kernel(x, weight)
                bias = getattr(module, "bias", None)
                return out if bias is None else out + bias
        return apply_linear(module, x, self.path, self.tile)

    def run(self, groups: list[RowGroup], path: str = "gemm") -> StepOutput:
        """One forward over the groups' rows, every linear layer along `path`."""
        t0 = time.perf_counter()
        self.path = path
        logits_rows, sampled = self._forward(groups)
        samples = self._sample(logits_rows, sampled) if sampled else {}
        traces = self._traces(groups, logits_rows, sampled) if any(g.trace for g in groups) else {}
        return StepOutput(samples=samples, model_time=time.perf_counter() - t0, traces=traces)

    def _traces(self, groups, logits_rows, sampled) -> dict[str, StepTrace]:
        """Copy the keys and values each traced group just wrote, and its logits."""
        bs = self.pool.block_size
        out = {}
        for g in groups:
            if not g.trace:
                continue
            slots = mx.array(_slots(g.block_table, g.start + g.num_rows, bs)[g.start:])
            kv = mx.stack([mx.stack(self.pool.read(layer, slots))
                           for layer in range(len(self.layers))])
            logits = None
            if g.sample:
                logits = np.array(logits_rows[sampled.index(g)].astype(mx.float32))
            out[g.seq_id] = StepTrace(np.array(kv.astype(mx.float32)), logits)
        return out

    # ---- forward ---------------------------------------------------------------------------
    def _forward(self, groups: list[RowGroup]) -> tuple[mx.array | None, list[RowGroup]]:
        bs = self.pool.block_size
        tokens, positions, write_slots, contexts = [], [], [], []
        for g in groups:
            tokens.extend(g.token_ids)
            positions.extend(range(g.start, g.start + g.num_rows))
            ctx_len = g.start + g.num_rows
            write_slots.append(_slots(g.block_table, ctx_len, bs)[g.start:])
            contexts.append((g.num_rows, ctx_len, g.block_table))
        write = mx.array(np.concatenate(write_slots))
        plan = plan_step(contexts, bs, native=self.attention_kernel is not None)
        pos = mx.array(positions, dtype=mx.int32)
        rows = len(tokens)

        x = self.inner.embed_tokens(mx.array(tokens)[None])  # (1, rows, hidden)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, layer.input_layernorm(x), pos, write, plan, rows)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))

        sampled = [g for g in groups if g.sample]
        if not sampled:
            mx.eval(self.pool.state())
            return None, []
        last_rows, r = [], 0
        for g in groups:
            r += g.num_rows
            if g.sample:
                last_rows.append(r - 1)
        h = self.inner.norm(x[:, mx.array(last_rows)])  # (1, sampled, hidden)
        if hasattr(self.model, "lm_head"):
            logits = self.linear(self.model.lm_head, h)
        else:  # tied embeddings
            embed = self.inner.embed_tokens
            logits = self.linear(embed.as_linear, h, _float32_weight(embed, nn.Embedding))
        return logits[0], sampled

    def _attention(self, layer_index, layer, h, pos, write, plan, rows):
        attn = layer.self_attn
        n_heads, n_kv = attn.n_heads, attn.n_kv_heads
        q = self.linear(attn.q_proj, h).reshape(rows, n_heads, -1)
        k = self.linear(attn.k_proj, h).reshape(rows, n_kv, -1)
        v = self.linear(attn.v_proj, h).reshape(rows, n_kv, -1)
        if hasattr(attn, "q_norm"):  # qwen3-style per-head norms
            q, k = attn.q_norm(q), attn.k_norm(k)
        # Each row is its own "batch" entry so RoPE takes a per-row position. Queries and keys
        # go through one call, half the calls: RoPE rotates each head alone, so the bits are
        # those of two calls (tests/engine/test_attention.py).
        qk = attn.rope(mx.concatenate([q, k], axis=1)[:, :, None, :], offset=pos)[:, :, 0, :]
        q, k = qk[:, :n_heads], qk[:, n_heads:]
        self.pool.write(layer_index, write, k, v)

        o = attend_step(q, plan, self.pool, layer_index, attn.scale, self.fused_attention,
                        self.attention_kernel)
        return self.linear(attn.o_proj, o[None])

    def _mlp(self, mlp, h):
        # Not mlx-lm's compiled `swiglu`: a function compiled on a non-main thread makes the
        # process abort at exit (MLX 0.32). The uncompiled form gives bit-identical results.
        gate = self.linear(mlp.gate_proj, h)
        return self.linear(mlp.down_proj, nn.silu(gate) * self.linear(mlp.up_proj, h))

    # ---- sampling ----------------------------------------------------------------------------
    def _sample(self, logits: mx.array, groups: list[RowGroup]) -> dict[str, Sample]:
        # Same arithmetic as mlx-lm's generate: log-softmax in the model's dtype, then argmax.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        chosen = []
        for i, g in enumerate(groups):
            p = g.params
            if p is None or p.greedy:
                chosen.append(greedy[i])
            else:
                chosen.append(_sample_row(logprobs[i], p, g.output_index))
        token_ids = mx.stack(chosen)
        token_lp = mx.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        k = max((g.params.logprobs if g.params else 0) for g in groups)
        top_ids = top_lp = None
        if k:
            top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
            top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
            mx.eval(token_ids, token_lp, top_ids, top_lp, self.pool.state())
        else:
            mx.eval(token_ids, token_lp, self.pool.state())
        ids_list = token_ids.tolist()
        lp_list = token_lp.astype(mx.float32).tolist()
        top_ids_l = top_ids.tolist() if k else None
        top_lp_l = top_lp.astype(mx.float32).tolist() if k else None
        out = {}
        for i, g in enumerate(groups):
            top: list[tuple[int, float]] = []
            want = g.params.logprobs if g.params else 0
            if want:
                pairs = sorted(zip(top_ids_l[i], top_lp_l[i], strict=True), key=lambda t: -t[1])
                top = pairs[:want]
            out[g.seq_id] = Sample(ids_list[i], lp_list[i], top)
        return out


def _decode_kernel(decode_attention: str, fused: bool):
    """The native decode-attention op to use, or None for MLX ops (see engine/attention.py)."""
    return _native_op("decode_attention", decode_attention, fused, native.paged_decode_attention)


def _matmul_kernel(decode_matmul: str, fused: bool):
    """The native decode linear op to use, or None for MLX's matmul."""
    return _native_op("decode_matmul", decode_matmul, fused, native.decode_linear)


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


def _sample_row(logprobs: mx.array, p: SamplingParams, output_index: int) -> mx.array:
    from mlx_lm.sample_utils import apply_top_k, apply_top_p

    x = logprobs[None]
    if 0.0 < p.top_p < 1.0:
        x = apply_top_p(x, p.top_p)
    if 0 < p.top_k < x.shape[-1]:
        x = apply_top_k(x, p.top_k)
    # A key per (seed, token index): the same request samples the same tokens whatever
    # shares its batch, and a preempted request resumes on the same random stream.
    key = None
    if p.seed is not None:
        key = mx.random.key((p.seed * 1_000_003 + output_index) % (2**63))
    return mx.random.categorical(x * (1.0 / p.temperature), key=key)[0]


def _slots(block_table: list[int], num_tokens: int, block_size: int) -> np.ndarray:
    """Pool slots of positions [0, num_tokens) of a sequence with this block table."""
    n_blocks = -(-num_tokens // block_size)
    table = np.asarray(block_table[:n_blocks], dtype=np.int64)
    return (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]
