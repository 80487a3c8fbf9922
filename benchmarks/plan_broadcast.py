"""Per-step cost of tensor parallelism's plan broadcast on loopback (engine/distributed/).

Two ranks over MLX's ring backend on 127.0.0.1 run a tiny random-weight llama (f32, sharded)
through rank 0's Coordinator: a prefill step of every sequence, then decode steps of 1, 8 and
16 rows. Per decode step it reports rank 0's time in the plan broadcast (encode excluded), in
the per-step all_gather of the ranks' times, and the step's wall time on rank 0 (plan out,
forward with its two all_sums per layer, sampling, the gather), median and p90. On a 2-core
machine both ranks and the ring's busy-polling socket threads share the cores, so tails are
long; the median is the number to read.

    .venv/bin/python benchmarks/plan_broadcast.py [--steps 200]
"""

from __future__ import annotations

import argparse
import importlib
import platform
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
    got: dict[str, list[float]] = {"broadcast": [], "gather": [], "wall": []}
    for n in range(steps):
        groups = [RowGroup(f"s{i}", [out.sampled[f"s{i}"].samples[-1].token_id],
                           PROMPT + n, tables[i], True, params, output_index=n + 1)
                  for i in range(rows)]
        t0 = time.perf_counter()
        out, times = coordinator.step(groups)
        got["wall"].append(time.perf_counter() - t0)
        got["broadcast"].append(times.broadcast_s[0])
        got["gather"].append(times.gather_s)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="decode steps per row count")
    ap.add_argument("--out", default="benchmarks/results/plan_broadcast.md")
    args = ap.parse_args()
    rows_list = (1, 8, 16)
    num_blocks = max(rows_list) * -(-(PROMPT + args.steps + 1) // BLOCK_SIZE)
    module_name, config = FAMILY_CONFIGS["llama"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_family_folder(Path(tmp) / "llama", importlib.import_module(
            f"mlx_lm.models.{module_name}"), config))
        group, ranks = start_ranks(2, worker_args(folder, num_blocks, BLOCK_SIZE,
                                                  weights="f32"))
        coordinator = Coordinator(group, sharded_runner(load_model(folder, "f32"), group,
                                                        num_blocks, BLOCK_SIZE), ranks)
        results = {rows: bench(coordinator, rows, args.steps) for rows in rows_list}
        coordinator.stop()

    def ms(values: list[float], pct: float) -> str:
        return f"{1000 * percentile(values, pct):.3f}"

    lines = [
        f"Two ranks on 127.0.0.1 over MLX's ring backend (mlx {mx.__version__}, "
        f"{platform.machine()}, backend cpu), tiny random-weight llama (hidden 64, 3 layers, "
        f"f32, sharded), {args.steps} decode steps per row count after a prefill step; "
        "benchmarks/plan_broadcast.py. Times on rank 0, ms: the plan broadcast (one 4 KiB "
        "all_sum: every plan here fits one frame), the per-step all_gather of the ranks' "
        "times (the collective time beside the model's own two all_sums per layer), and the "
        "whole step.",
        "",
        "| rows | broadcast p50 | broadcast p90 | gather p50 | gather p90 | broadcast + gather "
        "p50 | step p50 | step p90 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows, got in results.items():
        both = [b + g for b, g in zip(got["broadcast"], got["gather"], strict=True)]
        lines.append(f"| {rows} | {ms(got['broadcast'], 50)} | {ms(got['broadcast'], 90)} | "
                     f"{ms(got['gather'], 50)} | {ms(got['gather'], 90)} | {ms(both, 50)} | "
                     f"{ms(got['wall'], 50)} | {ms(got['wall'], 90)} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
