"""Where a decode step's time goes: attention over the paged pool vs mlx-lm's padded batch.

Two measurements, each interleaved round by round so that machine noise hits all variants alike
(the tables give the fastest round and the median):

1. One layer's attention for C decode rows (SmolLM2-135M shapes, contexts of 52-152 tokens, as in
   benchmarks/engine_batching.py after 32 tokens): gathering the contexts from the paged pool
   slot by slot and block by block, the engine's per-sequence attention in MLX ops, the native
   paged kernel (engine/native/, reads the pool directly), and mlx-lm's way (a contiguous
   padded cache, one fused call with a mask), with the largest differences between outputs.
2. A whole decode step of the real model at C rows: the engine's forward with the native kernel
   and with MLX ops, the same with attention left out, and mlx-lm's batched forward on a
   BatchKVCache.
3. One layer's attention for a prefill chunk (--chunk rows, 512 by default) at the end of a
   context of N tokens (--prefill-contexts): the native kernel against the MLX-ops path
   (gather + masked matmuls + softmax), with the arithmetic rate each reaches.
4. One decode row at a depth of N tokens (--decode-depths) through the native kernel in 30
   layers (the model's count: their keys and values do not stay in the cache between steps),
   for a float32, float16 and bfloat16 pool (--kv-dtype), with the bytes of keys and values
   read per second.
5. Decode rows (--placement-rows) at a context of --placement-context tokens through the native
   kernel in 30 layers of a float32 pool, each sequence's blocks consecutive in the pool against
   the same blocks shuffled through it (engine/block_manager.py keeps them consecutive where it
   can): where the blocks lie changes no number, only how fast the keys and values are read.

    .venv/bin/python benchmarks/attention.py [--weights f32] [--concurrency 4 8 16] [--rounds 15]
        [--layers-only] [--prefill-contexts 512 2048 4096 8192] [--chunk 512]
        [--decode-depths 1024 4096 8192] [--placement-rows 1 8] [--placement-context 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache
# isort: on

import engine.step as step_module
from engine import native
from engine.attention import Span, attend
from engine.kv_cache import KVPool
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import RowGroup

BLOCK = 16


def context_lengths(c: int) -> list[int]:
    return [20 + (i * 37) % 100 + 32 for i in range(c)]


def timed_rounds(variants: dict, rounds: int) -> dict[str, list[float]]:
    for fn in variants.values():  # warm-up
        fn()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def layer_attention(c: int, rounds: int, heads=9, kv_heads=3, dim=64, num_blocks=1024):
    rng = np.random.default_rng(c)
    lens = context_lengths(c)
    pool = KVPool(1, num_blocks, BLOCK, kv_heads, dim)
    fill = mx.array(rng.standard_normal((num_blocks * BLOCK, kv_heads, dim)).astype(np.float32))
    pool.write(0, mx.arange(num_blocks * BLOCK), fill, fill * 0.5)
    tables, slots, spans, ctx, next_block = [], [], [], 0, 0
    for i, n in enumerate(lens):
        nb = -(-n // BLOCK)
        table = list(range(next_block, next_block + nb))
        next_block += nb + 3  # not adjacent: a real pool is fragmented
        tables.extend(table)
        slots.extend((np.array(table)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:n])
        spans.append(Span(i, 1, ctx, n))
        ctx += nb * BLOCK
    blocks, slots = mx.array(tables), mx.array(np.array(slots))
    q = mx.array(rng.standard_normal((c, heads, dim)).astype(np.float32))
    scale = dim ** -0.5
    # mlx-lm's layout: one contiguous (C, kv_heads, L, dim) cache, left-padded, and a mask.
    longest = max(lens)
    keys_all, values_all = pool.read_blocks(0, blocks)
    kpad = np.zeros((c, kv_heads, longest, dim), np.float32)
    vpad = np.zeros_like(kpad)
    mask = np.zeros((c, 1, 1, longest), bool)
    for i, s in enumerate(spans):
        kpad[i, :, longest - s.ctx_len:] = np.array(keys_all[:, s.ctx:s.ctx + s.ctx_len])
        vpad[i, :, longest - s.ctx_len:] = np.array(values_all[:, s.ctx:s.ctx + s.ctx_len])
        mask[i, ..., longest - s.ctx_len:] = True
    kpad, vpad, mask, q4 = mx.array(kpad), mx.array(vpad), mx.array(mask), q[:, :, None, :]
    mx.eval(q, kpad, vpad, mask, q4)

    def engine_path():
        k, v = pool.read_blocks(0, blocks)
        return attend(q, k, v, spans, scale, fused=False)

    def padded():
        return mx.fast.scaled_dot_product_attention(q4, kpad, vpad, scale=scale, mask=mask)

    kernel = native.paged_attention()
    width = max(-(-n // BLOCK) for n in lens)
    table = np.zeros((c, width), np.int32)
    at = 0
    for i, n in enumerate(lens):
        nb = -(-n // BLOCK)
        table[i, :nb] = tables[at:at + nb]
        at += nb
    table, ctx_lens = mx.array(table), mx.array(np.asarray(lens, np.int32))

    def native_path():
        return kernel(q, *pool.layer(0), table, ctx_lens, mx.ones(c, dtype=mx.int32), scale,
                      BLOCK)

    ops = engine_path()
    deltas = {"MLX-ops path vs padded": mx.max(mx.abs(ops - padded().reshape(c, heads * dim)))}
    variants = {
        "gather by slot": lambda: mx.eval(pool.read(0, slots)),
        "gather by block": lambda: mx.eval(pool.read_blocks(0, blocks)),
        "engine, MLX ops: gather + exact attention": lambda: mx.eval(engine_path()),
        "mlx-lm: padded fused attention": lambda: mx.eval(padded()),
    }
    if kernel is not None:
        deltas["native kernel vs MLX-ops path"] = mx.max(mx.abs(native_path() - ops))
        variants["engine, native paged kernel"] = lambda: mx.eval(native_path())
    return timed_rounds(variants, rounds), {k: v.item() for k, v in deltas.items()}


def prefill_layer(ctx: int, chunk: int, rounds: int, heads=9, kv_heads=3, dim=64):
    """One layer's attention for the last `chunk` rows of a context of ctx tokens."""
    rng = np.random.default_rng(ctx)
    nb = -(-ctx // BLOCK)
    pool = KVPool(1, 2 * nb + 2, BLOCK, kv_heads, dim)
    fill = mx.array(rng.standard_normal((pool.num_slots, kv_heads, dim)).astype(np.float32))
    pool.write(0, mx.arange(pool.num_slots), fill, fill * 0.5)
    blocks = [int(b) for b in rng.permutation(pool.num_blocks)[:nb]]  # fragmented
    q = mx.array(rng.standard_normal((chunk, heads, dim)).astype(np.float32))
    scale = dim ** -0.5
    read = mx.array(blocks)
    kernel = native.paged_attention()
    variants = {"MLX ops: gather + exact attention": lambda: mx.eval(attend(
        q, *pool.read_blocks(0, read), [Span(0, chunk, 0, ctx)], scale, fused=False))}
    if kernel is not None:
        table = mx.array(np.asarray([blocks], np.int32))
        lens, qlens = mx.array([ctx], dtype=mx.int32), mx.array([chunk], dtype=mx.int32)
        variants["native paged kernel"] = lambda: mx.eval(
            kernel(q, *pool.layer(0), table, lens, qlens, scale, BLOCK))
    times = timed_rounds(variants, rounds)
    # Multiply-adds of the scores and of the values, over the causal part only.
    pairs = chunk * (ctx - chunk) + chunk * (chunk + 1) / 2
    flop = 2 * 2 * pairs * heads * dim
    return times, {name: flop / min(ts) / 1e9 for name, ts in times.items()}


DEPTH_LAYERS = 30
POOL_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def decode_depth(depth: int, rounds: int, kernel, heads=9, kv_heads=3, dim=64):
    """One decode row at `depth` through DEPTH_LAYERS layers of each pool dtype (same contents,
    rounded to the dtype, fragmented blocks), interleaved: times and GB/s of keys and values."""
    rng = np.random.default_rng(depth)
    nb = -(-depth // BLOCK)
    num_blocks = nb + 4
    fill = rng.standard_normal((num_blocks * BLOCK, kv_heads, dim)).astype(np.float32)
    table = mx.array(np.asarray([rng.permutation(num_blocks)[:nb]], np.int32))
    q = mx.array(rng.standard_normal((1, heads, dim)).astype(np.float32))
    lens, qlens = mx.array([depth], dtype=mx.int32), mx.array([1], dtype=mx.int32)
    variants, nbytes = {}, {}
    for name, dtype in POOL_DTYPES.items():
        pool = KVPool(DEPTH_LAYERS, num_blocks, BLOCK, kv_heads, dim, dtype=dtype)
        for layer in range(DEPTH_LAYERS):
            pool.write(layer, mx.arange(num_blocks * BLOCK), mx.array(fill),
                       mx.array(fill * 0.5))

        def step(pool=pool):
            mx.eval([kernel(q, *pool.layer(i), table, lens, qlens, dim ** -0.5, BLOCK)
                     for i in range(DEPTH_LAYERS)])

        variants[f"{name} pool"] = step
        nbytes[f"{name} pool"] = 2 * DEPTH_LAYERS * depth * kv_heads * dim * dtype.size
    times = timed_rounds(variants, rounds)
    return times, {name: nbytes[name] / min(ts) / 1e9 for name, ts in times.items()}


def block_placement(rows: int, context: int, rounds: int, kernel, heads=9, kv_heads=3, dim=64):
    """`rows` decode rows at `context` through DEPTH_LAYERS layers of a float32 pool, each
    sequence's blocks consecutive against the same blocks shuffled, interleaved: times, GB/s of
    keys and values, and the largest difference between the two outputs (0: the same bits)."""
    rng = np.random.default_rng(context)
    nb = -(-context // BLOCK)
    num_blocks = rows * nb + 4
    fill = rng.standard_normal((num_blocks * BLOCK, kv_heads, dim)).astype(np.float32)
    pool = KVPool(DEPTH_LAYERS, num_blocks, BLOCK, kv_heads, dim, dtype=mx.float32)
    for layer in range(DEPTH_LAYERS):
        pool.write(layer, mx.arange(num_blocks * BLOCK), mx.array(fill), mx.array(fill * 0.5))
    consecutive = np.arange(rows * nb, dtype=np.int32).reshape(rows, nb)
    shuffled = rng.permutation(num_blocks)[:rows * nb].astype(np.int32).reshape(rows, nb)
    # The shuffled pool holds each block's keys where its table now points: the same contents.
    moved = fill.reshape(num_blocks, BLOCK, kv_heads, dim).copy()
    moved[shuffled.ravel()] = fill.reshape(num_blocks, BLOCK, kv_heads, dim)[consecutive.ravel()]
    moved_pool = KVPool(DEPTH_LAYERS, num_blocks, BLOCK, kv_heads, dim, dtype=mx.float32)
    for layer in range(DEPTH_LAYERS):
        flat = moved.reshape(-1, kv_heads, dim)
        moved_pool.write(layer, mx.arange(num_blocks * BLOCK), mx.array(flat),
                         mx.array(flat * 0.5))
    q = mx.array(rng.standard_normal((rows, heads, dim)).astype(np.float32))
    lens = mx.array([context] * rows, dtype=mx.int32)
    qlens = mx.array([1] * rows, dtype=mx.int32)

    def run(p, table):
        return [kernel(q, *p.layer(i), table, lens, qlens, dim ** -0.5, BLOCK)
                for i in range(DEPTH_LAYERS)]

    sides = {"consecutive blocks": (pool, mx.array(consecutive)),
             "shuffled blocks": (moved_pool, mx.array(shuffled))}
    outputs = {name: run(*side) for name, side in sides.items()}
    mx.eval(list(outputs.values()))
    delta = max(float(mx.max(mx.abs(a - b)))
                for a, b in zip(*outputs.values(), strict=True))
    times = timed_rounds({name: (lambda side=side: mx.eval(run(*side)))
                          for name, side in sides.items()}, rounds)
    nbytes = 2 * DEPTH_LAYERS * rows * context * kv_heads * dim * 4
    return times, {name: nbytes / min(ts) / 1e9 for name, ts in times.items()}, delta


def decode_step(loaded, c: int, rounds: int):
    """The real model's decode step at c rows: engine forward (with and without attention) and
    mlx-lm's batched forward, over the same context lengths."""
    model = loaded.model
    args = model.args
    lens = context_lengths(c)
    pool = KVPool(loaded.num_layers, 1024, BLOCK, args.num_key_value_heads,
                  args.hidden_size // args.num_attention_heads)
    runner = ModelRunner(model, pool, "auto")
    mlx_ops = ModelRunner(model, pool, "mlx")
    groups, prefill, next_block = [], [], 0
    for i, n in enumerate(lens):
        nb = -(-(n + 1) // BLOCK)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        prefill.append(RowGroup(f"s{i}", [5] * n, 0, table, False))
        groups.append(RowGroup(f"s{i}", [100 + i], n, table, True, SamplingParams()))
    runner.run(prefill)
    longest = max(lens)
    caches = [BatchKVCache([longest - n for n in lens]) for _ in range(loaded.num_layers)]
    mx.eval(model(mx.array([[5] * longest] * c), cache=caches))

    def mlx_lm_step():
        logits = model(mx.array([[100 + i] for i in range(c)]), cache=caches)[:, -1]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(mx.argmax(logprobs, axis=-1), [cache.state for cache in caches])
        for cache in caches:  # step back, so every round decodes at the same length
            cache._idx -= 1
            cache.offset = cache.offset - 1

    real_attend = step_module.attend_step

    def without_attention():
        def skip(q, *args):
            return q.reshape(q.shape[0], -1)

        step_module.attend_step = skip
        try:
            runner.run(groups)
        finally:
            step_module.attend_step = real_attend

    variants = {"engine step": lambda: runner.run(groups)}
    if runner.attention_kernel is not None:
        variants["engine step, MLX-ops attention"] = lambda: mlx_ops.run(groups)
    variants |= {"engine step without attention": without_attention,
                 "mlx-lm batched step": mlx_lm_step}
    return timed_rounds(variants, rounds)


def table(title: str, times: dict[str, list[float]], unit=1e3) -> list[str]:
    lines = [f"| {title} | fastest (ms) | median (ms) |", "|---|---|---|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {min(ts) * unit:.3f} | {statistics.median(ts) * unit:.3f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4, 8, 16],
                    help="decode rows of the short-context measurements (none: skip them)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/attention.md")
    ap.add_argument("--layers-only", action="store_true",
                    help="only the one-layer measurements (no model, no whole steps)")
    ap.add_argument("--prefill-contexts", type=int, nargs="*", default=[512, 2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=512, help="rows of the prefill chunk")
    ap.add_argument("--decode-depths", type=int, nargs="*", default=[1024, 4096, 8192],
                    help="contexts of the decode-at-depth measurement (none: skip it)")
    ap.add_argument("--placement-rows", type=int, nargs="*", default=[],
                    help="decode rows of the block-placement measurement (none: skip it)")
    ap.add_argument("--placement-context", type=int, default=300,
                    help="each row's context in the block-placement measurement")
    args = ap.parse_args()

    loaded = None if args.layers_only else load_model("embedded", args.weights)
    kernel = "built" if native.paged_attention() else f"unavailable: {native.why_not()}"
    model = "one layer only" if loaded is None else f"Model {loaded.name}, weights {loaded.weights}"
    short = "; decode rows at contexts of 52-152 tokens" if args.concurrency else ""
    out = [f"{model}, backend {mx.default_device()}; {args.rounds} interleaved rounds{short}; "
           f"native kernel {kernel}.", ""]
    for c in args.concurrency:
        print(f"# {c} decode rows: one layer's attention...", file=sys.stderr, flush=True)
        layer, deltas = layer_attention(c, args.rounds)
        out += [f"### {c} decode rows", ""] + table("one layer", layer) + [""]
        out += [f"Largest |difference| in the attention output, {name}: {d:.2e}"
                for name, d in deltas.items()] + [""]
        if loaded is None:
            continue
        print(f"# {c} decode rows: whole step...", file=sys.stderr, flush=True)
        step = decode_step(loaded, c, args.rounds)
        ratio = min(step["mlx-lm batched step"]) / min(step["engine step"])
        out += table("whole decode step", step)
        out += ["", f"mlx-lm step time / engine step time (fastest rounds): {ratio:.2f}x", ""]
    for ctx in args.prefill_contexts:
        chunk = min(args.chunk, ctx)
        print(f"# prefill chunk of {chunk} rows at context {ctx}...", file=sys.stderr,
              flush=True)
        times, rates = prefill_layer(ctx, chunk, max(3, args.rounds // 3))
        out += [f"### A {chunk}-row prefill chunk ending a {ctx}-token context", ""]
        out += table("one layer", times) + [""]
        out += [f"GFLOP/s (fastest round), {name}: {r:.1f}" for name, r in rates.items()]
        if len(rates) == 2:
            ops, kernel = rates.values()
            out.append(f"native kernel / MLX ops: {kernel / ops:.2f}x")
        out.append("")
    paged = native.paged_attention()
    for depth in args.decode_depths if paged is not None else []:
        print(f"# a decode row at depth {depth}, {DEPTH_LAYERS} layers...", file=sys.stderr,
              flush=True)
        times, rates = decode_depth(depth, args.rounds, paged)
        out += [f"### One decode row at depth {depth}, {DEPTH_LAYERS} layers, native kernel", ""]
        out += table(f"{DEPTH_LAYERS} layers", times) + [""]
        out += [f"GB/s of keys and values (fastest round), {name}: {r:.1f}"
                for name, r in rates.items()]
        f32, f16 = min(times["float32 pool"]), min(times["float16 pool"])
        out += [f"float32 pool time / float16 pool time: {f32 / f16:.2f}x", ""]
    for rows in args.placement_rows if paged is not None else []:
        ctx = args.placement_context
        print(f"# {rows} decode rows at context {ctx}, block placement...", file=sys.stderr,
              flush=True)
        times, rates, delta = block_placement(rows, ctx, args.rounds, paged)
        out += [f"### {rows} decode rows at context {ctx}, {DEPTH_LAYERS} layers, float32 pool, "
                "native kernel", ""]
        out += table(f"{DEPTH_LAYERS} layers", times) + [""]
        out += [f"GB/s of keys and values (fastest round), {name}: {r:.1f}"
                for name, r in rates.items()]
        shuffled, consecutive = min(times["shuffled blocks"]), min(times["consecutive blocks"])
        out += [f"shuffled time / consecutive time: {shuffled / consecutive:.2f}x",
                f"Largest |difference| between the two outputs: {delta:.1e}", ""]
    text = "\n".join(out)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    print(f"(written to {args.out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
