"""The linear layers of a decode step: the native float32 kernel against MLX's matmul.

For R rows, runs every linear layer of the real model once (7 per block, then the tied
lm_head), as a decode step does: each weight is read from memory, not from a cache warmed by a
repeat. Variants are interleaved round by round so machine noise hits both alike. This is the
measurement behind DECODE_MATMUL_MAX_ROWS in engine/model_runner.py.

    .venv/bin/python benchmarks/decode_linear.py [--rows 1 4 8 16 24 32] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx.core as mx
# isort: on

from attention import timed_rounds  # benchmarks/attention.py (this script's folder)

from engine import native
from engine.model_loader import load_model
from engine.model_runner import DECODE_MATMUL_MAX_ROWS
from engine.platform import backend_info, blas_name

PROJECTIONS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj")]


def model_weights(model) -> list[mx.array]:
    weights = [getattr(getattr(layer, block), name).weight
               for layer in model.model.layers for block, name in PROJECTIONS]
    head = getattr(model, "lm_head", None)
    weights.append(head.weight if head is not None else model.model.embed_tokens.weight)
    return weights


def measure(weights, rows: int, rounds: int, kernel) -> dict[str, list[float]]:
    inputs = {w.shape[1]: mx.random.normal((1, rows, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))
    variants = {
        "MLX matmul": lambda: mx.eval([inputs[w.shape[1]] @ w.T for w in weights]),
        "native kernel": lambda: mx.eval([kernel(inputs[w.shape[1]], w) for w in weights]),
    }
    return timed_rounds(variants, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="f32", help="must be float32 (the kernel's format)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode_linear.md"))
    args = ap.parse_args()
    kernel = native.decode_linear()
    if kernel is None:
        print(f"native kernel {native.why_not()}", file=sys.stderr)
        return 2
    loaded = load_model("embedded", args.weights)
    weights = model_weights(loaded.model)
    if weights[0].dtype != mx.float32:
        print(f"--weights {args.weights} gives {weights[0].dtype}; the kernel takes float32",
              file=sys.stderr)
        return 2
    info = backend_info()
    blas = blas_name(info.get("blas")) or "bundled"
    lines = [f"All {len(weights)} linear layers of {loaded.name} ({args.weights}) once per round, "
             f"backend {info['backend']}, BLAS {blas}; {args.rounds} interleaved rounds. "
             f"The engine uses the kernel up to {DECODE_MATMUL_MAX_ROWS} rows.", "",
             "| rows | MLX matmul (ms) | native kernel (ms) | MLX / native, median "
             "| fastest rounds |",
             "|---|---|---|---|---|"]
    for rows in args.rows:
        print(f"# {rows} rows...", file=sys.stderr, flush=True)
        t = measure(weights, rows, args.rounds, kernel)
        mlx_med, nat_med = statistics.median(t["MLX matmul"]), statistics.median(t["native kernel"])
        ratios = [a / b for a, b in zip(t["MLX matmul"], t["native kernel"], strict=True)]
        lines.append(f"| {rows} | {mlx_med * 1e3:.1f} | {nat_med * 1e3:.1f} | "
                     f"{statistics.median(ratios):.2f}x | "
                     f"{min(t['MLX matmul']) / min(t['native kernel']):.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"(written to {args.out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
