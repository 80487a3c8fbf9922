"""Where a decode step's time goes, at 1, 4, 8 and 16 rows.

The step as the engine runs it (ModelRunner.run on decode rows at a context of ~100 tokens):
how many MLX primitives its graph holds (each one scheduled by the engine thread and run on
MLX's stream thread), its time split into building the graph in Python and evaluating it, and
the same step with the fused decoder layer turned off (engine/native/decoder_layer.h: each
layer's ~25 ops dispatched one by one). Then the parts of the op-by-op layers, each timed alone
over all layers with the step's own shapes and kernels, dispatch included: the linear layers
(as the step calls them: q/k/v and gate/up stacked), the head, attention with its KV write, the
RMS norms and RoPE. Scheduling (the engine's own bookkeeping per step, outside the model) comes
from the step records of an engine run. Medians of --rounds.

Then the quantized kernel on its own, as the fused layer calls it (no MLX dispatch): every
linear layer of the step (q/k/v and gate/up stacked, as the fused layer holds them) and then
the head, in that order each round, so the head's weights come from memory as in a step; and,
in the same run, what the native threads read from memory (a 512 MB buffer). At one row the
script puts the two side by side: how far the kernels are from reading at memory speed.

"Python share" is the share of a step spent in Python outside evaluation: building the graph
plus the engine's scheduling, over the step plus scheduling, where each step is built after the
one before has computed. Then the engine's own decode steps (33 new tokens a request), built
one after another (--no-async-scheduling) and with async scheduling (the next step built and
queued while one computes, engine/lookahead.py), at a median context of CONTEXT, in
alternating runs; with async scheduling, the Python share is what a step takes beyond
evaluating its graph alone.

    .venv/bin/python benchmarks/step_profile.py [--weights q4] [--rows 1 4 8 16]
        [--activations float32|int8]

--steps N only runs N decode steps at each --rows count through ModelRunner.run and prints
their median, writing nothing: a steady workload for a sampling profiler, e.g.
`perf record -F 4000 .venv/bin/python benchmarks/step_profile.py --rows 1 --steps 1500`.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx.core as mx
import engine_batching as eb  # benchmarks/engine_batching.py (the script directory is on sys.path)
from decode_linear import model_layers  # benchmarks/decode_linear.py
# isort: on

from engine import native
from engine.config import ACTIVATIONS
from engine.engine import Engine
from engine.model_loader import load_model
from engine.model_runner import ModelRunner, pool_for
from engine.models import family_for
from engine.platform import backend_info
from engine.sampling import SamplingParams
from engine.scheduler import RowGroup
from engine.step import Step

CONTEXT = 100
TOKENS = 33  # decode steps per request in the engine's runs


def median_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def blocks_for(rows: int, context: int = CONTEXT) -> int:
    """The pool blocks decode_groups' rows take (block size 16)."""
    return rows * -(-(context + 1) // 16)


def decode_runner(loaded, blocks: int = 512, activations: str = "float32") -> ModelRunner:
    """A ModelRunner on `loaded` with a pool of `blocks` blocks of 16, the engine's default
    attention and row kernels (its family: runner.family)."""
    family = family_for(loaded.model)
    return ModelRunner(loaded.model, pool_for(family, blocks, 16), "auto", "auto", family,
                       activations=activations)


def decode_groups(rows: int, context: int = CONTEXT) -> tuple[list[RowGroup], list[RowGroup]]:
    prefill, decode, block = [], [], 0
    blocks = blocks_for(1, context)
    for i in range(rows):
        table = list(range(block, block + blocks))
        block += blocks
        prefill.append(RowGroup(f"s{i}", [(7 * j + i) % 200 + 3 for j in range(context)], 0,
                                table, False))
        decode.append(RowGroup(f"s{i}", [40 + i], context, table, True, SamplingParams()))
    return prefill, decode


GRAPH_OPS = "ops in the step's graph (MLX primitives queued)"  # a count, not ms


def graph_ops(*arrays: mx.array) -> int:
    """How many primitives the unevaluated graph of `arrays` holds (what mx.async_eval queues:
    each is scheduled on the engine thread and run on MLX's stream thread)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue().count("shape=rectangle")


def profile(runner: ModelRunner, family, rows: int, rounds: int) -> dict[str, float]:
    prefill, decode = decode_groups(rows)
    runner.run(prefill)
    # The step's graph is queued with mx.async_eval (engine/sampler.py) and waited for when
    # its samples are read: graph building is the time before that call, evaluation after.
    queued = [0.0]
    ops = []  # the queued graph's size, counted on the first step (not timed)
    real_async_eval = mx.async_eval

    def timed_async_eval(*args):
        if not ops:
            ops.append(graph_ops(*args))
        queued[0] = time.perf_counter()
        real_async_eval(*args)

    steps, evals = [], []
    mx.async_eval = timed_async_eval
    try:
        runner.run(decode)
        for _ in range(rounds):
            t0 = time.perf_counter()
            runner.run(decode)
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            evals.append(t1 - queued[0])
    finally:
        mx.async_eval = real_async_eval
    step, evaluated = statistics.median(steps) * 1e3, statistics.median(evals) * 1e3
    # The same step with every layer op by op (no fused decoder layer), for comparison.
    fused, runner.layer_kernel = runner.layer_kernel, None
    try:
        unfused = median_ms(lambda: runner.run(decode), rounds)
    finally:
        runner.layer_kernel = fused

    layers = family.layers
    hidden = layers[0].mlp.down_proj.weight.shape[0]
    inner = layers[0].mlp.gate_proj.weight.shape[0]
    sample = Step(runner, decode)
    x = mx.random.normal((1, rows, hidden))
    h = mx.random.normal((1, rows, inner))
    a0 = layers[0].self_attn
    q = mx.random.normal((rows, a0.n_heads, hidden // a0.n_heads))
    k = mx.random.normal((rows, a0.n_kv_heads, hidden // a0.n_heads))
    mx.eval(x, h, q, k)

    def linears():
        outs = []
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            outs += sample.linears([a.q_proj, a.k_proj, a.v_proj], x)
            outs.append(sample.linear(a.o_proj, x))
            outs += sample.linears([m.gate_proj, m.up_proj], x)
            outs.append(sample.linear(m.down_proj, h))
        mx.eval(outs)

    def attention():
        mx.eval([sample.attend(i, q, k, k, 0.125) for i in range(len(layers))],
                runner.pool.state())

    def norms():
        mx.eval([sample.norm(n, x) for layer in layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)])

    def rope():
        mx.eval([r for layer in layers for r in sample.rope(layer.self_attn.rope, q, k)])

    parts = {"linear layers": median_ms(linears, rounds),
             "head": median_ms(lambda: mx.eval(family.head(sample, x)), rounds),
             "attention + KV write": median_ms(attention, rounds),
             "RMS norms": median_ms(norms, rounds), "RoPE": median_ms(rope, rounds)}
    return {GRAPH_OPS: ops[0], "step": step, "step, layers op by op": unfused,
            "graph building": step - evaluated, "evaluation": evaluated,
            **{f"{name}, alone op by op": ms for name, ms in parts.items()}}


def steady_steps(runner: ModelRunner, rows: int, steps: int, context: int = CONTEXT) -> float:
    """The median ms of `steps` decode steps of `rows` rows at `context`, after a prefill and
    warm-up (the runner's pool holds blocks_for(rows, context) blocks)."""
    prefill, decode = decode_groups(rows, context)
    runner.run(prefill)
    for _ in range(5):
        runner.run(decode)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.run(decode)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


READ_BYTES = 512 * 2**20  # the memory-read measurement's buffer: far more than any cache
LINEARS_ALONE, HEAD_ALONE = "linear layers, kernel alone", "head, kernel alone"  # table rows


def kernel_layers(runner: ModelRunner, model) -> tuple[list, object] | None:
    """The quantized layers a step's kernel calls, as the fused layer holds them (q/k/v and
    gate/up stacked), and the head; None where a layer has no fused op or a layer is not
    quantized (the float32 kernel is another measurement)."""
    linears = []
    for i in range(len(runner.family.layers)):
        layer = runner.fused_layer_of(i)
        if layer is None:
            return None
        spec = layer.spec
        linears += [spec.qkv, spec.o, spec.gate_up, spec.down]
    head = model_layers(model)[-1]
    if any(not lin.bits for lin in linears) or getattr(head, "bits", 0) == 0:
        return None
    return linears, head


def layer_bytes(layers) -> int:
    return sum(a.nbytes for lin in layers for a in (lin.weight, lin.scales, lin.biases))


def time_in_turn(every: list, rows: int, rounds: int) -> list[list[float]]:
    """Seconds of each layer in `every` through the quantized kernel alone, called in turn,
    per round (`rounds` of them after a warm-up round), with the activations the step's layers
    take (--activations int8: the kernel's int8 option)."""
    _, time_quantized_linears = native.kernel_timing()
    return time_quantized_linears(
        [lin.weight for lin in every], [lin.scales for lin in every],
        [lin.biases for lin in every], [lin.bits for lin in every],
        [lin.group_size for lin in every], rows=rows, rounds=rounds + 1,
        int8_activations=every[0].int8_activations)[1:]


def kernel_alone(layers: tuple[list, object], rows: int, rounds: int) -> dict[str, float]:
    """ms of the linear layers and of the head through the quantized kernel on its own (every
    linear layer, then the head, each round; medians of `rounds`)."""
    linears, head = layers
    times = time_in_turn([*linears, head], rows, rounds)
    return {LINEARS_ALONE: statistics.median(sum(t[:-1]) for t in times) * 1e3,
            HEAD_ALONE: statistics.median(t[-1] for t in times) * 1e3}


def kernel_in_cache(layers: tuple[list, object], rounds: int) -> float:
    """GB/s of the quantized kernel at one row on the first linear layer (block 0's stacked
    q/k/v) alone, called as many times a round as a step has linear layers: a few hundred KB
    that stay in the cores' caches, so memory does not set this rate (the median of
    `rounds`)."""
    linears, _ = layers
    times = time_in_turn([linears[0]] * len(linears), 1, rounds)
    return layer_bytes(linears[:1]) * len(linears) / statistics.median(map(sum, times)) / 1e9


def engine_steps(weights: str, rows: list[int], activations: str,
                 rounds: int = 5) -> dict[bool, dict]:
    """The engine's own decode steps, steps built one after another (async_scheduling off)
    and with async scheduling, in alternating runs of two engines (`rounds` each): per row
    count, the median step (wall_time: consecutive steps' tile the timeline), the engine's time
    outside the model (scheduler_time), ms, and the share of steps overlapped, over requests
    whose prompts are decode_groups' (a median context of CONTEXT)."""
    engines = {}
    for overlap in (False, True):
        config = eb.engine_config(weights, rows)
        config.activations, config.async_scheduling = activations, overlap
        engines[overlap] = Engine(config).start()
    samples = {overlap: {n: [] for n in rows} for overlap in engines}
    try:
        for _ in range(rounds):
            for n in rows:
                # Prompts TOKENS / 2 short of CONTEXT: the decode steps' median context.
                prompts = [g.token_ids[:CONTEXT - TOKENS // 2] for g in decode_groups(n)[0]]
                for overlap, eng in engines.items():
                    first = eng.step_count + 1
                    eb.run_engine(eng, prompts, TOKENS)
                    recs = [r for r in eng.steps.recent()
                            if r.step >= first and not r.prefill_rows]
                    samples[overlap][n] += recs[2:]  # the first follow the prefill's own
    finally:
        for eng in engines.values():
            eng.stop()
    return {overlap: {n: {"step": statistics.median(r.wall_time for r in recs) * 1e3,
                          "scheduling": statistics.median(r.scheduler_time for r in recs) * 1e3,
                          "overlapped": sum(r.overlapped for r in recs) / len(recs)}
                      for n, recs in by_rows.items()}
            for overlap, by_rows in samples.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="q4")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--activations", default="float32", choices=ACTIVATIONS)
    ap.add_argument("--steps", type=int, default=0,
                    help="only run this many steps per row count and print their median")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_profile.md"))
    args = ap.parse_args()
    loaded = load_model("embedded", args.weights)
    runner = decode_runner(loaded, activations=args.activations)
    family = runner.family
    if args.steps:
        for n in args.rows:
            ms = steady_steps(runner, n, args.steps)
            print(f"{n} rows: median step {ms:.2f} ms over {args.steps} steps")
        return 0
    table = {}
    kernels = kernel_layers(runner, loaded.model) if native.kernel_timing() else None
    for n in args.rows:
        print(f"# {n} rows...", file=sys.stderr, flush=True)
        table[n] = profile(runner, family, n, args.rounds)
        if kernels:
            table[n] |= kernel_alone(kernels, n, args.rounds)
    steps = engine_steps(args.weights, args.rows, args.activations)
    sched = {n: steps[False][n]["scheduling"] for n in args.rows}
    names = list(next(iter(table.values())))
    lines = [f"A decode step of {loaded.name} ({args.weights}), context {CONTEXT}, backend "
             f"{backend_info()['backend']}, native quantized path "
             f"{native.decode_quantized_isa()}, {args.activations} activations, "
             f"{native.threads()} native threads; ms, medians "
             f"of {args.rounds}. The parts are timed alone (see the script's docstring).", "",
             "| ms | " + " | ".join(f"{n} rows" for n in args.rows) + " |",
             "|---|" + "---|" * len(args.rows)]

    def row(name: str, values: dict[int, float], form: str = "{:.1f}") -> None:
        lines.append(f"| {name} | " + " | ".join(form.format(values[n]) for n in args.rows)
                     + " |")

    for name in names:
        row(name, {n: table[n][name] for n in args.rows}, "{:.0f}" if name == GRAPH_OPS
            else "{:.1f}")
    row("scheduling (engine, outside the model)", sched)
    row("Python share (graph building + scheduling)",
        {n: (table[n]["graph building"] + sched[n]) / (table[n]["step"] + sched[n])
         for n in args.rows}, "{:.0%}")
    row("engine step, built after the one before", {n: steps[False][n]["step"]
                                                    for n in args.rows})
    row("engine step, async scheduling", {n: steps[True][n]["step"] for n in args.rows})
    row("steps overlapped, async scheduling", {n: steps[True][n]["overlapped"]
                                               for n in args.rows}, "{:.0%}")
    # What a step costs beyond evaluating its graph: Python and scheduling not hidden.
    row("Python share, async scheduling (engine step beyond evaluation)",
        {n: max(0.0, steps[True][n]["step"] - table[n]["evaluation"]) / steps[True][n]["step"]
         for n in args.rows}, "{:.0%}")
    row("async scheduling / built after (step time)",
        {n: steps[False][n]["step"] / steps[True][n]["step"] for n in args.rows}, "{:.2f}x")
    if 1 in table and kernels:
        read_bandwidth, _ = native.kernel_timing()
        memory = read_bandwidth(READ_BYTES, 5)
        cached = kernel_in_cache(kernels, args.rounds)
        linears, head = kernels

        def read(mb: float, ms: float) -> str:  # MB per ms is GB/s
            return f"{mb:.0f} MB in {ms:.2f} ms ({mb / ms:.1f} GB/s, {mb / ms / memory:.0%})"

        lines += ["", "At 1 row the quantized kernel alone reads the linear layers' "
                  f"{read(layer_bytes(linears) / 1e6, table[1][LINEARS_ALONE])} and the head's "
                  f"{read(layer_bytes([head]) / 1e6, table[1][HEAD_ALONE])}; the "
                  f"percentages are of the {memory:.1f} GB/s the same {native.threads()} native "
                  f"threads read from memory in this run (the best of 5 reads of a "
                  f"{READ_BYTES // 2**20} MB buffer). The same kernel on block 0's q/k/v alone, "
                  f"called {len(linears)} times a round so that its "
                  f"{layer_bytes(linears[:1]) / 1e6:.2f} MB stay in the cores' caches, reads "
                  f"{cached:.1f} GB/s."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
