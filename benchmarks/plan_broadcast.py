"""Per-step cost of tensor parallelism's plan broadcast on loopback (engine/distributed/).

Two ranks over MLX's ring backend on 127.0.0.1 run a tiny random-weight llama (f32, sharded)
through rank 0's Coordinator: a prefill step of every sequence, then decode steps of 1, 8 and
16 rows. Per decode step it reports rank 0's time in the plan broadcast (encode excluded), in
the per-step all_gather of the ranks' times, and the step's wall time on rank 0 (plan out,
forward with its two all_sums per layer, sampling, the gather), median and p90, and rank 0's
time in the forward's all_sums (engine/collectives.py). Timing those cuts the step's graph at
each all_sum, so the ranks also run with it off, in alternating rounds, and the step's median
both ways gives its cost. On a 2-core machine both ranks and the ring's busy-polling socket
threads share the cores, so tails are long; the median is the number to read.

    .venv/bin/python benchmarks/plan_broadcast.py [--steps 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from app.stats import percentile
from engine.distributed.launch import start_ranks
from engine.distributed.worker import Coordinator, sharded_runner, worker_args
from engine.model_loader import load_model
from engine.sampling import SamplingParams
from engine.scheduler import RowGroup
from engine.testing import FAMILY_CONFIGS, make_family_folder

BLOCK_SIZE, PROMPT = 16, 8


def bench(coordinator: Coordinator, rows: int, steps: int) -> dict[str, list[float]]:
    """Decode steps of `rows` sequences (one row each) after their prefill."""
    blocks = -(-(PROMPT + steps + 1) // BLOCK_SIZE)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(rows)]
    params = SamplingParams()
    groups = [RowGroup(f"s{i}", [5 + i] * PROMPT, 0, tables[i], True, params)
              for i in range(rows)]
    out, _ = coordinator.step(groups)
    got: dict[str, list[float]] = {"broadcast": [], "gather": [], "wall": [], "all_sum": []}
    for n in range(steps):
        groups = [RowGroup(f"s{i}", [out.sampled[f"s{i}"].samples[-1].token_id],
                           PROMPT + n, tables[i], True, params, output_index=n + 1)
                  for i in range(rows)]
        t0 = time.perf_counter()
        out, times = coordinator.step(groups)
        got["wall"].append(time.perf_counter() - t0)
        got["broadcast"].append(times.broadcast_s[0])
        got["gather"].append(times.gather_s)
        got["all_sum"].append(times.all_sum_s[0])
    return got


def run_ranks(folder: str, num_blocks: int, rows_list: tuple[int, ...], steps: int,
              timed: bool) -> dict[int, dict[str, list[float]]]:
    """Two ranks started over `folder`, every row count benched, the ranks stopped."""
    group, ranks = start_ranks(2, worker_args(folder, num_blocks, BLOCK_SIZE, weights="f32",
                                              time_collectives=timed))
    coordinator = Coordinator(group, sharded_runner(load_model(folder, "f32"), group,
                                                    num_blocks, BLOCK_SIZE,
                                                    time_collectives=timed), ranks)
    try:
        return {rows: bench(coordinator, rows, steps) for rows in rows_list}
    finally:
        coordinator.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="decode steps per row count")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternating rounds with the all_sums timed and not")
    ap.add_argument("--out", default="benchmarks/results/plan_broadcast.md")
    ap.add_argument("--one-round", choices=("timed", "untimed"),
                    help=argparse.SUPPRESS)  # a round in a process of its own: JSON to --out
    args = ap.parse_args()
    rows_list = (1, 8, 16)
    num_blocks = max(rows_list) * -(-(PROMPT + args.steps + 1) // BLOCK_SIZE)
    module_name, config = FAMILY_CONFIGS["llama"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_family_folder(Path(tmp) / "llama", importlib.import_module(
            f"mlx_lm.models.{module_name}"), config))
        if args.one_round:
            got = run_ranks(folder, num_blocks, rows_list, args.steps,
                            args.one_round == "timed")
            Path(args.out).write_text(json.dumps(got))
            return 0
        # Each round in a process of its own: MLX joins one ring per process.
        # mode -> rows -> what bench() measures -> samples of every round
        results = {mode: {rows: {} for rows in rows_list} for mode in ("timed", "untimed")}
        for i in range(2 * args.rounds):
            mode = "timed" if i % 2 == 0 else "untimed"
            print(f"round {i // 2 + 1}/{args.rounds}, all_sums {mode}", flush=True)
            out = Path(tmp) / f"round{i}.json"
            subprocess.run([sys.executable, __file__, "--one-round", mode, "--steps",
                            str(args.steps), "--out", str(out)], check=True)
            for rows, got in json.loads(out.read_text()).items():
                for name, samples in got.items():
                    results[mode][int(rows)].setdefault(name, []).extend(samples)

    def ms(values: list[float], pct: float) -> str:
        return f"{1000 * percentile(values, pct):.3f}"

    lines = [
        f"Two ranks on 127.0.0.1 over MLX's ring backend (mlx {mx.__version__}, "
        f"{platform.machine()}, backend cpu), tiny random-weight llama (hidden 64, 3 layers, "
        f"f32, sharded), {args.steps} decode steps per row count after a prefill step; "
        "benchmarks/plan_broadcast.py. Times on rank 0, ms: the plan broadcast (one 4 KiB "
        "all_sum: every plan here fits one frame), the per-step all_gather of the ranks' "
        "times, the forward's own all_sums (two per layer, timed: engine/collectives.py), and "
        f"the whole step; {args.rounds} alternating rounds of the ranks with the all_sums "
        "timed and not, the step's median both ways (timed / not: what timing them costs).",
        "",
        "| rows | broadcast p50 | broadcast p90 | gather p50 | gather p90 | broadcast + gather "
        "p50 | all_sums p50 | all_sums p90 | step p50 | step p90 | step p50, not timed "
        "| timed / not |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows, got in results["timed"].items():
        bare = results["untimed"][rows]["wall"]
        both = [b + g for b, g in zip(got["broadcast"], got["gather"], strict=True)]
        cost = percentile(got["wall"], 50) / percentile(bare, 50)
        lines.append(f"| {rows} | {ms(got['broadcast'], 50)} | {ms(got['broadcast'], 90)} | "
                     f"{ms(got['gather'], 50)} | {ms(got['gather'], 90)} | {ms(both, 50)} | "
                     f"{ms(got['all_sum'], 50)} | {ms(got['all_sum'], 90)} | "
                     f"{ms(got['wall'], 50)} | {ms(got['wall'], 90)} | {ms(bare, 50)} | "
                     f"{cost:.2f}x |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
