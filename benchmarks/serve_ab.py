"""Two builds' servers under the one-stream load of `bench serve`, in alternating rounds.

The load of `benchmarks/llama_cpp_peer.py --sections serve1`: 12 requests of the seeded
`mixed` dataset, one at a time, ignore_eos, through the load client of `batchscope bench serve`
(app/bench/client.py, run in this process). `batchscope serve` from revision --base (a temporary
git worktree with its own native kernels, as benchmarks/build_ab.py builds it) and from the
working tree run side by side (default flags but --weights, a runs database each); each round
drives both, in an order that alternates, after one warm-up load each. A change whose effect is
a few percent needs many rounds here: the machine's rate drifts by more than that within a run.
The table gives each server's medians and the median of the per-round ratios (working tree /
base) with their quartiles and range.

    .venv/bin/python benchmarks/serve_ab.py --base REV [--weights auto] [--rounds 20]

Writes benchmarks/results/serve_ab.{md,json} unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on
# benchmarks/build_ab.py, llama_cpp_peer.py and peers.py (the script directory is on sys.path)
from build_ab import backend_line, base_tree, short_rev, write_results
from llama_cpp_peer import SERVE_ONE_PROMPTS
from peers import free_port, running_server, server_commands

from app.bench import dataset as datasets
from app.bench.client import probe, run_load
from app.bench.metrics import summarize
from app.cli.bench import DEFAULT_CONTEXT

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDES = ("base", "tree")


def drive(url: str, requests: list) -> dict:
    results, duration = asyncio.run(run_load(url, requests, max_concurrency=1,
                                             ignore_eos=True, seed=0))
    s = summarize(results, duration)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} of {len(requests)} requests failed at {url}")
    return {"output_tps": s["output_throughput"], "tpot_ms": s["tpot"]["median_ms"],
            "ttft_ms": s["ttft"]["median_ms"]}


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def summarize_rounds(rounds: list[dict]) -> dict:
    out = {side: {k: statistics.median(r[side][k] for r in rounds)
                  for k in ("output_tps", "tpot_ms", "ttft_ms")} for side in SIDES}
    ratios = [r["tree"]["output_tps"] / r["base"]["output_tps"] for r in rounds]
    lo, hi = quartiles(ratios)
    out["ratio"] = {"median": statistics.median(ratios), "q1": lo, "q3": hi,
                    "min": min(ratios), "max": max(ratios)}
    return out


def render(summary: dict, meta: dict) -> str:
    r = summary["ratio"]
    lines = [
        f"`benchmarks/serve_ab.py`, {meta['date']}: `batchscope serve` from {meta['base']} and "
        f"from the working tree (at {meta['head']}), side by side, {meta['rounds']} rounds of the "
        f"one-stream `bench serve` load ({SERVE_ONE_PROMPTS} `mixed` requests, seed 0, one at a "
        f"time, ignore_eos) on each in alternating order; weights {meta['weights']}, "
        f"{meta['backend']}.", "",
        "| server | output tok/s | median TPOT ms | median TTFT ms |", "|---|---|---|---|"]
    for side in SIDES:
        s = summary[side]
        name = meta["base"] if side == "base" else "working tree"
        lines.append(f"| {name} | {s['output_tps']:.1f} | {s['tpot_ms']:.2f} | "
                     f"{s['ttft_ms']:.1f} |")
    lines += ["", f"Working tree / base, output tok/s: {r['median']:.3f}x (median of the rounds' "
                  f"own; quartiles {r['q1']:.3f}-{r['q3']:.3f}x, range "
                  f"{r['min']:.2f}-{r['max']:.2f}x).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to serve beside the tree")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=str(HERE / "results" / "serve_ab"))
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    with tempfile.TemporaryDirectory(prefix="serve-ab-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        trees = {"base": stack.enter_context(base_tree(args.base, work)), "tree": ROOT}
        urls = {}
        for side, tree in trees.items():
            port = free_port()
            cmd = server_commands("batchscope", port, args.weights, work, work / f"{side}.db")
            urls[side], _ = stack.enter_context(
                running_server(side, cmd, port, work / f"{side}.log", log, tree))
        info = probe(urls["tree"])
        requests = datasets.load("mixed", SERVE_ONE_PROMPTS, seed=0,
                                 context=info.max_model_len or DEFAULT_CONTEXT)
        for side in SIDES:  # warm-up: the prompts' prefixes cached, as in the peer's warm rounds
            drive(urls[side], requests)
        rounds = []
        for i in range(args.rounds):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            result = {side: drive(urls[side], requests) for side in order}
            rounds.append(result)
            log(f"round {i + 1}/{args.rounds}: " + ", ".join(
                f"{side} {result[side]['output_tps']:.1f} tok/s" for side in SIDES))

    summary = summarize_rounds(rounds)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "base": short_rev(args.base),
            "head": short_rev("HEAD"),
            "rounds": args.rounds, "weights": args.weights, "backend": backend_line()}
    write_results(Path(args.out), {"meta": meta, "summary": summary, "rounds": rounds},
                  render(summary, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
