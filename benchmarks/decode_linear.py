"""The linear layers of a decode step: the native float32 kernel against MLX's matmul.

For R rows, runs every linear layer of the real model once (7 per block, then the tied
lm_head), as a decode step does: each weight is read from memory, not from a cache warmed by a
repeat. Variants are interleaved round by round so machine noise hits both alike. This is the
measurement behind DECODE_MATMUL_MAX_ROWS in engine/native_ops.py.

--weights q4: the shipped 4-bit layers (and the 8-bit tied head) through the native quantized
kernel against MLX's quantized_matmul (the modules' own call), against the float32 kernel
on the same model dequantized to float32 (DECODE_QUANTIZED_MAX_ROWS), and against itself with
int8 activations (--activations int8).

    .venv/bin/python benchmarks/decode_linear.py [--rows 1 4 8 16 24 32] [--rounds 9]
    .venv/bin/python benchmarks/decode_linear.py --weights q4
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
from engine.native_ops import DECODE_MATMUL_MAX_ROWS, DECODE_QUANTIZED_MAX_ROWS
from engine.platform import backend_info, blas_name

PROJECTIONS = [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj")]


def model_layers(model) -> list:
    layers = [getattr(getattr(layer, block), name)
              for layer in model.model.layers for block, name in PROJECTIONS]
    head = getattr(model, "lm_head", None)
    layers.append(head if head is not None else model.model.embed_tokens)
    return layers


def model_weights(model) -> list[mx.array]:
    return [layer.weight for layer in model_layers(model)]


def float32_kernel():
    """The native float32 linear as the engine runs it, as a function of (x, weight): each
    weight packed once, before any timing (the engine packs a layer on its first call)."""
    op, pack = native.decode_linear(), native.pack_linear_weight()
    if op is None:
        return None
    packed: dict[int, tuple[mx.array, mx.array]] = {}

    def linear(x, weight):
        if id(weight) not in packed:
            packed[id(weight)] = (weight, pack(weight))
            mx.eval(packed[id(weight)][1])
        return op(x, packed[id(weight)][1], weight.shape[0])

    return linear


def measure_quantized(layers, weights, rows: int, rounds: int, kernel,
                      f32_kernel) -> dict[str, list[float]]:
    """layers: the q4 model's modules; weights: the same model's float32 weights."""
    inputs = {w.shape[1]: mx.random.normal((1, rows, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))
    calls = [(layer.as_linear if hasattr(layer, "as_linear") else layer, inputs[w.shape[1]])
             for layer, w in zip(layers, weights, strict=True)]
    variants = {
        "MLX quantized_matmul": lambda: mx.eval([fn(x) for fn, x in calls]),
        "native q4": lambda: mx.eval([
            kernel(inputs[w.shape[1]], m.weight, m.scales, m.biases, m.group_size, m.bits)
            for m, w in zip(layers, weights, strict=True)]),
        "native f32": lambda: mx.eval([f32_kernel(inputs[w.shape[1]], w) for w in weights]),
        "native q4, int8 activations": lambda: mx.eval([
            kernel(inputs[w.shape[1]], m.weight, m.scales, m.biases, m.group_size, m.bits,
                   int8_activations=True)
            for m, w in zip(layers, weights, strict=True)]),
    }
    return timed_rounds(variants, rounds)


def main_quantized(args) -> int:
    kernel, f32_kernel = native.decode_quantized_linear(), float32_kernel()
    if kernel is None:
        print(f"native kernel {native.why_not()}", file=sys.stderr)
        return 2
    q4 = load_model("embedded", "q4")
    layers = model_layers(q4.model)
    weights = model_weights(load_model("embedded", "f32").model)
    info = backend_info()
    lines = [f"All {len(layers)} linear layers of {q4.name} (q4: 4-bit linears, 8-bit tied "
             f"head) once per round, backend {info['backend']}, native path "
             f"{native.decode_quantized_isa()}, threads {native.threads()}; "
             f"{args.rounds} interleaved rounds. The f32 column is the float32 kernel on the "
             f"model dequantized to float32; int8: the q4 kernel with --activations int8 "
             f"({native.int8_activations_isa()} path). The engine uses the q4 kernel up to "
             f"{DECODE_QUANTIZED_MAX_ROWS} rows.", "",
             "| rows | MLX quantized_matmul (ms) | native q4 (ms) | native f32 (ms) "
             "| q4, int8 activations (ms) | MLX / q4, median | f32 / q4, median "
             "| q4 / int8, median |",
             "|---|---|---|---|---|---|---|---|"]
    for rows in args.rows:
        print(f"# {rows} rows...", file=sys.stderr, flush=True)
        t = measure_quantized(layers, weights, rows, args.rounds, kernel, f32_kernel)
        med = {name: statistics.median(v) for name, v in t.items()}
        q = t["native q4"]
        mlx_ratio = statistics.median(
            a / b for a, b in zip(t["MLX quantized_matmul"], q, strict=True))
        f32_ratio = statistics.median(a / b for a, b in zip(t["native f32"], q, strict=True))
        int8 = t["native q4, int8 activations"]
        int8_ratio = statistics.median(a / b for a, b in zip(q, int8, strict=True))
        lines.append(f"| {rows} | {med['MLX quantized_matmul'] * 1e3:.1f} | "
                     f"{med['native q4'] * 1e3:.1f} | {med['native f32'] * 1e3:.1f} | "
                     f"{statistics.median(int8) * 1e3:.1f} | "
                     f"{mlx_ratio:.2f}x | {f32_ratio:.2f}x | {int8_ratio:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    print(f"(written to {args.out})", file=sys.stderr)
    return 0


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
    ap.add_argument("--weights", default="f32",
                    help="f32 (the float32 kernel) or q4 (the quantized kernel)")
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="default: 1 2 4 8 16 32 64 128 256 (q4: 1 2 4 8 16 32 64 128)")
    ap.add_argument("--rounds", type=int, default=None, help="default: 9 (q4: 5)")
    ap.add_argument("--out", default=None, help="default: results/decode_linear.md, "
                    "or results/decode_quantized.md for --weights q4")
    args = ap.parse_args()
    results = Path(__file__).parent / "results"
    if args.weights == "q4":
        args.out = args.out or str(results / "decode_quantized.md")
        args.rows = args.rows or [1, 2, 4, 8, 16, 32, 64, 128]
        args.rounds = args.rounds or 5
        return main_quantized(args)
    args.out = args.out or str(results / "decode_linear.md")
    args.rows = args.rows or [1, 2, 4, 8, 16, 32, 64, 128, 256]
    args.rounds = args.rounds or 9
    kernel = float32_kernel()
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
