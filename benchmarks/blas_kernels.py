"""Float32 matmuls on the OpenBLAS kernels batchscope selects against the ones OpenBLAS took by
itself, in one run.

    .venv/bin/python benchmarks/blas_kernels.py [--rounds 5] [--rows 16 64 256 512]

OpenBLAS picks its kernels by the CPU's model number; on a CPU its release does not know it
falls back to Prescott's SSE3 kernels, and engine/platform.py's preload_blas() then selects the
kernels the CPU's instruction sets run. Each round runs two child processes in turn (the order
alternating): one with the selection, one with OPENBLAS_CORETYPE naming the kernels OpenBLAS
took (a set OPENBLAS_CORETYPE is left as it is). Each child times MLX's float32 matmul on the
embedded model's linear shapes at --rows rows, and one forward over a 256-token prompt of the
model at f32 weights (mlx-lm's own, the prefill of f32 weights and of --attention mlx).
Reports medians over the rounds and the ratio. Where nothing was replaced on this machine, it
says so and exits with code 3.

Writes benchmarks/results/blas_kernels.{md,json} unless --out says otherwise.
"""

from __future__ import annotations

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_cpp_peer import cpu_model  # benchmarks/llama_cpp_peer.py (the script directory)

from engine.platform import CORETYPE_ENV, backend_info, blas_name

# (in_features, out_features) of the embedded model's linear layers: q/o, k/v, gate/up, down.
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576))
PREFILL_TOKENS = 256


def child(rows: list[int]) -> dict:
    """This process's timings: ms per matmul of each shape at each row count (min over
    repeats) and ms of one prefill (the best of 3)."""
    import mlx.core as mx

    from engine.model_loader import load_model

    def best(fn, repeats: int) -> float:
        mx.eval(fn())
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(fn())
            times.append(time.perf_counter() - t0)
        return min(times) * 1e3

    matmul = {}
    for n in rows:
        total = 0.0
        for k, out in SHAPES:
            x, w = mx.random.normal((n, k)), mx.random.normal((out, k))
            mx.eval(x, w)
            total += best(lambda x=x, w=w: x @ w.T, 20)
        matmul[n] = total
    model = load_model("embedded", "f32").model
    tokens = mx.array([[(i * 7919) % 40000 + 100 for i in range(PREFILL_TOKENS)]])
    prefill = best(lambda: model(tokens), 3)
    return {"kernels": backend_info()["blas_kernels"], "matmul_ms": matmul,
            "prefill_ms": prefill}


def run_child(rows: list[int], env: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *map(str, rows)], env=env,
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--out", default="benchmarks/results/blas_kernels.json")
    ap.add_argument("--child", type=int, nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0

    info = backend_info()
    if info["blas_kernels_replaced"] is None:
        print(f"nothing to compare here: BLAS {blas_name(info['blas']) or 'bundled'}, kernels "
              f"{info['blas_kernels'] or 'not named'}, as OpenBLAS took them", file=sys.stderr)
        return 3
    took, selected = info["blas_kernels_replaced"], info["blas_kernels"]
    base = {k: v for k, v in os.environ.items() if k != CORETYPE_ENV}
    envs = {selected: base, took: {**base, CORETYPE_ENV: took}}
    results: dict[str, list[dict]] = {selected: [], took: []}
    for rnd in range(args.rounds):
        order = list(envs) if rnd % 2 == 0 else list(envs)[::-1]
        for name in order:
            print(f"# round {rnd + 1} of {args.rounds}: {name} kernels...", file=sys.stderr,
                  flush=True)
            got = run_child(args.rows, envs[name])
            if got["kernels"] != name:
                raise SystemExit(f"the child ran {got['kernels']} kernels, not {name}")
            results[name].append(got)

    def med(name: str, pick) -> float:
        return statistics.median(pick(r) for r in results[name])

    lines = [f"Run {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, {os.cpu_count()} CPUs, BLAS "
             f"{blas_name(info['blas'])}: OpenBLAS took {took}'s kernels for this CPU, "
             f"batchscope selects {selected}'s. MLX's float32 matmul over the embedded model's "
             f"four linear shapes (ms, summed), and one f32 forward over a {PREFILL_TOKENS}-token "
             f"prompt; medians of {args.rounds} rounds, the two in turn.", "",
             f"| work | {took} ms | {selected} ms | {took} / {selected} |", "|---|---|---|---|"]
    rows = []
    for n in args.rows:
        a, b = med(took, lambda r, n=n: r["matmul_ms"][str(n)]), med(
            selected, lambda r, n=n: r["matmul_ms"][str(n)])
        rows.append({"work": f"matmuls, {n} rows", took: a, selected: b})
        lines.append(f"| matmuls, {n} rows | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    a, b = med(took, lambda r: r["prefill_ms"]), med(selected, lambda r: r["prefill_ms"])
    rows.append({"work": f"f32 prefill, {PREFILL_TOKENS} tokens", took: a, selected: b})
    lines.append(f"| f32 prefill, {PREFILL_TOKENS} tokens | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"took": took, "selected": selected, "rows": rows,
                               "raw": results}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
