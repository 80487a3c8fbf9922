"""`batchscope calibrate`: measure GEMV vs GEMM per concurrency and save the "auto" threshold.

    batchscope calibrate [--model embedded] [--weights auto] [--concurrency 1 2 3 4 8 16]
                         [--max-tokens 32] [--repeats 1] [--out DIR]

Progress goes to stderr (one line per measurement); the table, T and the paths to stdout.
"""

from __future__ import annotations

import argparse
import sys

from app.lab.calibration import DEFAULT_CONCURRENCY, ENV_DIR
from engine.config import WEIGHT_FORMATS


def add_calibrate_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="measure unbatched vs batched GEMM vs row-wise GEMV and save the "
                          "threshold --kernel-policy auto uses",
        description="For each concurrency N, run N requests unbatched, batched with one GEMM "
                    "per layer, and batched with one GEMV per row; save the largest N where "
                    "GEMV still wins as the threshold for --kernel-policy auto.")
    p.add_argument("--model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct) or a local mlx-lm model folder")
    p.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                   help="weight format to calibrate (each format gets its own threshold)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY),
                   metavar="N", help="concurrent requests to measure (default: "
                                     f"{' '.join(map(str, DEFAULT_CONCURRENCY))})")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per measurement; the best is kept (less noise, more time)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"directory for the JSON and SVG (default ${ENV_DIR} or "
                        "~/.cache/batchscope)")
    p.set_defaults(func=cmd_calibrate)
    return p


def cmd_calibrate(args: argparse.Namespace) -> int:
    from app.lab.calibration import calibrate, describe, describe_paths, render_table

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = calibrate(args.model, args.weights, args.concurrency, args.max_tokens, progress,
                       repeats=args.repeats, out_dir=args.out)
    print()
    print(describe(result) + f"; measured in {result['elapsed_s']:.0f} s")
    print()
    print(render_table(result))
    print(describe_paths(result))
    print()
    print(f"chosen threshold T = {result['threshold']} rows "
          f"(from the {result['threshold_basis']})")
    print(f"saved {result['path']}")
    print(f"plot  {result['plot_path']}")
    print(f"--kernel-policy auto now uses T = {result['threshold']} for this model, weights and "
          "backend unless --kernel-threshold is given")
    return 0
