"""A decode step with its attention on one thread against shared with the worker threads.

The native paged attention kernel hands a call's units of work (a kv head of a sequence's rows)
to the worker threads from a cost of keys x query heads / 16 on, summed over the call
(engine/native/paged_attention.cpp); below it, the calling thread computes them alone. This
script measures where that pays: the engine's decode step (ModelRunner.run on --rows decode
rows, the fused layers, the head and sampling, as benchmarks/step_profile.py --steps runs it)
at each --contexts, with the kernel's threshold set so that every call stays on one thread,
and at the kernel's default. The two alternate every STEPS_PER_TURN steps in one process, so
the machine's drift, which moves separate processes by more than the difference, hits both
alike. Which thread computes a unit changes no bit.

    .venv/bin/python benchmarks/attention_threads.py [--weights auto] [--rows 1]
        [--contexts 8 16 20 30 40 55 70 100 200 400] [--turns 60]

Writes benchmarks/results/attention_threads.{md,json} unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on
# benchmarks/build_ab.py and step_profile.py (the script directory is on sys.path)
from build_ab import backend_line, short_rev, write_results
from step_profile import blocks_for, decode_groups, decode_runner

from engine import native
from engine.model_loader import load_model

HERE = Path(__file__).resolve().parent
STEPS_PER_TURN = 10  # timed steps of one setting before the other's
ONE_THREAD = float("inf")  # a threshold no call reaches


def measure(runner, rows: int, context: int, turns: int, default_cost: float) -> dict:
    """Median ms of a decode step at `context` with the attention on one thread and at the
    default threshold, in `turns` alternating turns of each (the order flips every turn)."""
    prefill, decode = decode_groups(rows, context)
    runner.run(prefill)
    for _ in range(5):
        runner.run(decode)
    settings = {"one thread": ONE_THREAD, "shared": default_cost}
    times: dict[str, list[float]] = {name: [] for name in settings}
    try:
        for turn in range(turns):
            names = list(settings) if turn % 2 == 0 else list(settings)[::-1]
            for name in names:
                native.set_attention_parallel_cost(settings[name])
                runner.run(decode)  # the first step after a switch is not timed
                for _ in range(STEPS_PER_TURN):
                    t0 = time.perf_counter()
                    runner.run(decode)
                    times[name].append(time.perf_counter() - t0)
    finally:
        native.set_attention_parallel_cost(default_cost)
    one, shared = (statistics.median(times[n]) * 1e3 for n in settings)
    return {"one_thread_ms": one, "shared_ms": shared, "ratio": one / shared}


def render(results: dict, meta: dict) -> str:
    lines = [
        f"`benchmarks/attention_threads.py`, {meta['date']} (at {meta['head']}): the decode step "
        f"of {meta['model']} ({meta['weights']}) at {meta['rows']} decode row(s), its attention on "
        f"one thread against shared with the worker threads from the kernel's default cost "
        f"({meta['default_cost']:g}); {meta['turns']} alternating turns of {STEPS_PER_TURN} steps "
        f"each in one process, medians; {meta['threads']} native threads, {meta['backend']}.",
        "",
        "| context (keys) | cost | one thread ms | shared ms | one thread / shared |",
        "|---|---|---|---|---|"]
    for context, r in results.items():
        lines.append(f"| {context} | {r['cost']:.1f} | {r['one_thread_ms']:.3f} | "
                     f"{r['shared_ms']:.3f} | {r['ratio']:.3f}x |")
    lines += ["", "Cost: the step's attention cost per layer (keys x query heads / 16); below "
                  "the default the kernel keeps it on one thread.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[8, 16, 20, 30, 40, 55, 70, 100, 200, 400])
    ap.add_argument("--turns", type=int, default=60)
    ap.add_argument("--out", default=str(HERE / "results" / "attention_threads"))
    args = ap.parse_args()
    if args.turns < 1 or args.rows < 1 or min(args.contexts) < 1:
        ap.error("--turns, --rows and every context must be at least 1")
    if native.why_not():
        raise SystemExit(f"native kernels {native.why_not()}")

    loaded = load_model("embedded", args.weights)
    runner = decode_runner(loaded, max(512, blocks_for(args.rows, max(args.contexts))))
    default_cost = native.attention_parallel_cost()
    config = loaded.config
    heads = config["num_attention_heads"]
    results = {}
    for context in args.contexts:
        r = measure(runner, args.rows, context, args.turns, default_cost)
        r["cost"] = args.rows * context * heads / 16
        results[context] = r
        print(f"context {context}: one thread {r['one_thread_ms']:.3f} ms, shared "
              f"{r['shared_ms']:.3f} ms ({r['ratio']:.3f}x)", file=sys.stderr, flush=True)

    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "head": short_rev("HEAD"),
            "model": loaded.name, "weights": loaded.weights, "rows": args.rows,
            "turns": args.turns, "default_cost": default_cost, "threads": native.threads(),
            "backend": backend_line()}
    write_results(Path(args.out),
                  {"meta": meta, "results": {str(c): r for c, r in results.items()}},
                  render(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
