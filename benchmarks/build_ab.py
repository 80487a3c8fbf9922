"""Two builds of the engine back to back in one run: a base revision against the working tree.

For a change that must not change speed (a restructuring, a cleanup), measure both builds on
the same machine at the same time, since this kind of machine drifts between runs by more than
such a change should move.
The script checks the base revision out into a temporary git worktree and builds its native
kernels there, then runs interleaved rounds. In each round each build runs in a fresh process
of its own (same model, weights, prompts and engine set-up) and measures the engine's prefill
and decode tok/s at each concurrency the way benchmarks/engine_batching.py does: a call with
max_tokens=1, then one with max_tokens+1; decode from the extra time. The order of the two
builds alternates between rounds. The table gives each build's median and the median of the
per-round ratios (working tree / base) with their range.

    .venv/bin/python benchmarks/build_ab.py --base REV [--weights auto] [--concurrency 1 4 8 16]
        [--rounds 3] [--max-tokens 32]

--measure step times the model's decode step alone instead, for a change the engine's rates
are too noisy to show: ModelRunner.run on decode rows at a context of --context tokens (the fused
layers, the head and sampling, as benchmarks/step_profile.py --steps runs them), at each of
--rows; each process takes the median of STEPS steps. The ratio is base / working tree
(above 1: the working tree is faster).

    .venv/bin/python benchmarks/build_ab.py --base REV --measure step [--rows 1 2 4 8]
        [--context 100]

--measure kernel times the quantized kernel alone, for a change to it that a whole step is
still too noisy to show: the linear layers and then the head through quantized_linear_rows,
as the fused layer calls it (benchmarks/step_profile.py's kernel-alone rows); each process
takes the median of KERNEL_PASSES passes. Both revisions need engine.native.kernel_timing().

Writes benchmarks/results/build_ab.{md,json} (build_ab_step or build_ab_kernel with --measure
step or kernel) unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RATES = ("prefill_tps", "decode_tps")
STEPS = 300  # decode steps per process and row count (--measure step)
KERNEL_PASSES = 100  # passes over the layers per process and row count (--measure kernel)
KERNEL_KEYS = ("linears_ms", "head_ms")  # child_kernel's per row count, in this order


def child(weights: str, concurrency: list[int], max_tokens: int) -> dict:
    """Runs inside one build's process (PYTHONPATH names its tree): the engine's rates."""
    # isort: off
    import engine  # noqa: F401  (binds MLX to the optimized BLAS before mlx is imported)
    # isort: on
    from engine_batching import engine_config, make_prompts, measure, rates, run_engine

    from engine.engine import Engine
    from engine.model_loader import load_model

    loaded = load_model("embedded", weights)
    out = {"engine_file": engine.__file__, "weights": loaded.weights, "rows": {}}
    with Engine(engine_config(weights, concurrency), loader=lambda: loaded) as eng:
        run_engine(eng, make_prompts(loaded.tokenizer, 2), 4)  # warm-up
        for c in concurrency:
            prompts = make_prompts(loaded.tokenizer, c)
            m = measure(lambda p, n: run_engine(eng, p, n), prompts, max_tokens)
            out["rows"][str(c)] = rates(m)
    return out


def child_step(weights: str, rows: list[int], context: int) -> dict:
    """Runs inside one build's process: the median ms of a decode step per row count."""
    # isort: off
    import engine  # noqa: F401  (binds MLX to the optimized BLAS before mlx is imported)
    # isort: on
    from step_profile import blocks_for, decode_runner, steady_steps

    from engine.model_loader import load_model

    loaded = load_model("embedded", weights)
    runner = decode_runner(loaded, max(512, blocks_for(max(rows), context)))
    return {"engine_file": engine.__file__, "weights": loaded.weights,
            "rows": {str(r): {"ms": steady_steps(runner, r, STEPS, context)} for r in rows}}


def child_kernel(weights: str, rows: list[int]) -> dict:
    """Runs inside one build's process: the quantized kernel alone, ms per row count."""
    # isort: off
    import engine  # noqa: F401  (binds MLX to the optimized BLAS before mlx is imported)
    # isort: on
    from step_profile import HEAD_ALONE, LINEARS_ALONE, decode_runner, kernel_alone, kernel_layers

    from engine.model_loader import load_model

    loaded = load_model("embedded", weights)
    layers = kernel_layers(decode_runner(loaded), loaded.model)
    if layers is None:
        raise SystemExit(f"weights {loaded.weights}: no quantized layers for the kernel")
    times = {r: kernel_alone(layers, r, KERNEL_PASSES) for r in rows}
    labels = dict(zip(KERNEL_KEYS, (LINEARS_ALONE, HEAD_ALONE), strict=True))
    return {"engine_file": engine.__file__, "weights": loaded.weights,
            "rows": {str(r): {key: times[r][label] for key, label in labels.items()}
                     for r in rows}}


def run_build(tree: Path, args) -> dict:
    """One fresh process of the build in `tree`; its JSON result."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(HERE / "build_ab.py"), "--child", "--weights", args.weights,
           "--max-tokens", str(args.max_tokens), "--concurrency", *map(str, args.concurrency),
           "--measure", args.measure, "--rows", *map(str, args.rows),
           "--context", str(args.context)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"build in {tree} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    engine_file = result.pop("engine_file")  # checked, not kept: a path of this machine
    if not Path(engine_file).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the process for {tree} imported {engine_file}")
    return result


def write_results(out: Path, record: dict, table: str) -> None:
    """A benchmark's results: `record` as out.json, `table` as out.md (ending in a newline),
    and the table printed."""
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(table if table.endswith("\n") else table + "\n")
    print(table)


def backend_line(blas: bool = False) -> str:
    """The MLX version, backend and machine a result was measured on (and the BLAS library
    MLX's CPU backend loaded, with blas)."""
    from engine.platform import backend_info, blas_name

    info = backend_info()
    extra = f", BLAS {blas_name(info.get('blas'))}" if blas else ""
    return f"MLX {info['mlx_version']} on {info['backend']} ({info['machine']}{extra})"


def short_rev(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                          capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def base_tree(rev: str, where: Path):
    """A worktree of `rev` in `where` with its own native kernels built; removed after."""
    tree = where / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev],
                   check=True)
    try:
        print(f"# building the native kernels of {rev}...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "engine.native.build", "--quiet"], cwd=tree,
                       env=os.environ | {"PYTHONPATH": str(tree)}, check=True)
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       check=False)


def summarize(rounds: list[dict], concurrency: list[int]) -> list[dict]:
    rows = []
    for c in concurrency:
        row = {"concurrency": c}
        for k in RATES:
            base = [r["base"]["rows"][str(c)][k] for r in rounds]
            head = [r["head"]["rows"][str(c)][k] for r in rounds]
            ratios = [h / b for h, b in zip(head, base, strict=True)]
            row[k] = {"base": statistics.median(base), "head": statistics.median(head),
                      "ratio": statistics.median(ratios), "min": min(ratios),
                      "max": max(ratios)}
        rows.append(row)
    return rows


def summarize_step(rounds: list[dict], rows: list[int], key: str = "ms") -> list[dict]:
    out = []
    for r in rows:
        base = [x["base"]["rows"][str(r)][key] for x in rounds]
        head = [x["head"]["rows"][str(r)][key] for x in rounds]
        ratios = [b / h for b, h in zip(base, head, strict=True)]
        out.append({"rows": r, "base_ms": statistics.median(base),
                    "head_ms": statistics.median(head), "ratio": statistics.median(ratios),
                    "min": min(ratios), "max": max(ratios)})
    return out


def render_kernel(parts: dict[str, list[dict]], args, head_rev: str) -> str:
    lines = [f"The quantized kernel alone on the embedded model (weights {args.weights}), as the "
             f"fused layer calls it: the linear layers, then the head; base {args.base} against "
             f"the working tree (at {head_rev}): ms, each process the median of "
             f"{KERNEL_PASSES} passes, medians of {args.rounds} interleaved rounds, each build "
             "in a fresh process. Ratio: base / working tree (above 1: the working tree is "
             "faster), median of the rounds' ratios (lowest-highest).",
             "",
             "| rows | linears: base ms | working tree ms | ratio "
             "| head: base ms | working tree ms | ratio |",
             "|---|---|---|---|---|---|---|"]
    for lin, head in zip(parts["linears_ms"], parts["head_ms"], strict=True):
        lines.append(f"| {lin['rows']} | " + " | ".join(
            f"{p['base_ms']:.2f} | {p['head_ms']:.2f} | "
            f"{p['ratio']:.2f}x ({p['min']:.2f}-{p['max']:.2f})" for p in (lin, head)) + " |")
    return "\n".join(lines)


def render_step(rows: list[dict], args, head_rev: str) -> str:
    lines = [f"A decode step of the embedded model (weights {args.weights}; ModelRunner.run at a "
             f"context of {args.context} tokens), base {args.base} against the working tree (at "
             f"{head_rev}): ms, each process the median of {STEPS} steps, medians of "
             f"{args.rounds} interleaved rounds, each build in a fresh process. Ratio: base / "
             "working tree (above 1: the working tree is faster), median of the rounds' ratios "
             "(lowest-highest).",
             "",
             "| rows | base ms | working tree ms | ratio |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['base_ms']:.2f} | {r['head_ms']:.2f} | "
                     f"{r['ratio']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) |")
    return "\n".join(lines)


def render(rows: list[dict], args, head_rev: str) -> str:
    lines = [f"Engine prefill and decode tok/s, base {args.base} against the working tree "
             f"(at {head_rev}), weights {args.weights}, {args.max_tokens + 1}-token calls, "
             f"medians of {args.rounds} interleaved rounds, each build in a fresh process. "
             "Ratio: working tree / base, median of the rounds' ratios (lowest-highest).",
             "",
             "| requests | decode tok/s: base | working tree | ratio "
             "| prefill tok/s: base | working tree | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        d, p = r["decode_tps"], r["prefill_tps"]
        lines.append(f"| {r['concurrency']} | {d['base']:.1f} | {d['head']:.1f} | "
                     f"{d['ratio']:.2f}x ({d['min']:.2f}-{d['max']:.2f}) | {p['base']:.0f} | "
                     f"{p['head']:.0f} | {p['ratio']:.2f}x ({p['min']:.2f}-{p['max']:.2f}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the revision to compare against (git rev)")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--measure", choices=("engine", "step", "kernel"), default="engine",
                    help="engine: prefill and decode tok/s; step: a decode step alone; "
                    "kernel: the quantized kernel alone")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="--measure step or kernel: the row counts to time")
    ap.add_argument("--context", type=int, default=100,
                    help="--measure step: each decode row's context (default 100)")
    ap.add_argument("--out", default=None,
                    help="default: results/build_ab (results/build_ab_step with --measure step)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = (child_step(args.weights, args.rows, args.context) if args.measure == "step"
                  else child_kernel(args.weights, args.rows) if args.measure == "kernel"
                  else child(args.weights, args.concurrency, args.max_tokens))
        print(json.dumps(result))
        return
    if args.out is None:
        args.out = str(HERE / "results" / {"step": "build_ab_step", "kernel": "build_ab_kernel",
                                           "engine": "build_ab"}[args.measure])
    if not args.base:
        ap.error("--base is required")
    head_rev, base_rev = short_rev("HEAD"), short_rev(args.base)
    with tempfile.TemporaryDirectory() as tmp, base_tree(base_rev, Path(tmp)) as base:
        rounds = []
        for i in range(args.rounds):
            order = [("base", base), ("head", ROOT)]
            if i % 2:
                order.reverse()
            result = {}
            for name, tree in order:
                t0 = time.perf_counter()
                print(f"# round {i + 1}/{args.rounds}: {name}...", file=sys.stderr, flush=True)
                result[name] = run_build(tree, args)
                print(f"#   {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            rounds.append(result)
    if base_rev != args.base:  # a name (HEAD~1, a branch): the table says which commit it was
        args.base = f"{args.base} ({base_rev})"
    out = Path(args.out)
    if args.measure == "kernel":
        parts = {key: summarize_step(rounds, args.rows, key) for key in KERNEL_KEYS}
        table = render_kernel(parts, args, head_rev)
        record = {"base": args.base, "head": head_rev, "weights": args.weights,
                  "measure": "kernel", "passes": KERNEL_PASSES, "parts": parts,
                  "rounds": rounds}
    elif args.measure == "step":
        rows = summarize_step(rounds, args.rows)
        table = render_step(rows, args, head_rev)
        record = {"base": args.base, "head": head_rev, "weights": args.weights,
                  "measure": "step", "steps": STEPS, "context": args.context, "rows": rows,
                  "rounds": rounds}
    else:
        rows = summarize(rounds, args.concurrency)
        table = render(rows, args, head_rev)
        record = {"base": args.base, "head": head_rev, "weights": args.weights,
                  "max_tokens": args.max_tokens, "rows": rows, "rounds": rounds}
    write_results(out, record, table)


if __name__ == "__main__":
    main()
