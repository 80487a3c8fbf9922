"""The engine's own throughput per weights format: --weights q4 against --weights f32.

The same prompts and measurement as benchmarks/engine_batching.py (prefill from a 1-token
call, decode from the extra time of a max_tokens+1 call; C prompts of 20-120 tokens, greedy,
no EOS), for the engine only: mlx-lm's runs there take MLX's one-row-at-a-time CPU quantized
matmul at q4, which makes a q4 run of that script impractically long at 16 requests. Both
engines are started once and measured in interleaved rounds, so machine noise hits both alike.

    .venv/bin/python benchmarks/engine_weights.py [--concurrency 1 4 8 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on

from engine_batching import engine_config, make_prompts, measure, rates, run_engine

from engine import native
from engine.engine import Engine
from engine.platform import backend_info, blas_name

FORMATS = ("q4", "f32")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per concurrency")
    ap.add_argument("--out", default="benchmarks/results/engine_weights.json")
    args = ap.parse_args()
    engines = {w: Engine(engine_config(w, args.concurrency)).start() for w in FORMATS}
    tokenizer = engines["q4"].loaded.tokenizer
    for eng in engines.values():
        run_engine(eng, make_prompts(tokenizer, 2), 4)  # warm-up
    rows = []
    for c in args.concurrency:
        prompts = make_prompts(tokenizer, c)
        rounds = []
        for i in range(args.repeats):
            print(f"# concurrency {c}, round {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            rounds.append({w: rates(measure(lambda p, n, e=eng: run_engine(e, p, n), prompts,
                                            args.max_tokens))
                           for w, eng in engines.items()})
        row = {"concurrency": c, "rounds": rounds}
        for w in FORMATS:
            row[w] = {k: statistics.median(r[w][k] for r in rounds) for k in rounds[0][w]}
        row["ratio"] = {k: statistics.median(r["q4"][k] / r["f32"][k] for r in rounds)
                        for k in rounds[0]["q4"]}
        rows.append(row)
    descriptions = {w: eng.row_kernels for w, eng in engines.items()}
    for eng in engines.values():
        eng.stop()

    info = backend_info()
    lines = [f"Engine only, {engines['q4'].loaded.name}, backend {info['backend']}, BLAS "
             f"{blas_name(info.get('blas')) or 'bundled'}, native quantized path "
             f"{native.decode_quantized_isa()}; prompts of 20-120 tokens, greedy; prefill from "
             f"a 1-token call, decode from the extra time of a {args.max_tokens + 1}-token "
             f"call; medians of {args.repeats} interleaved rounds, ratio q4 / f32 the median "
             f"of the rounds' ratios. Row kernels: q4 {descriptions['q4']}; f32 "
             f"{descriptions['f32']}.", "",
             "| requests | decode tok/s: q4 | f32 | q4 / f32 | prefill tok/s: q4 | f32 "
             "| q4 / f32 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        q, f, ratio = r["q4"], r["f32"], r["ratio"]
        lines.append(f"| {r['concurrency']} | {q['decode_tps']:.1f} | {f['decode_tps']:.1f} | "
                     f"{ratio['decode_tps']:.2f}x | {q['prefill_tps']:.0f} | "
                     f"{f['prefill_tps']:.0f} | {ratio['prefill_tps']:.2f}x |")
    table = "\n".join(lines)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": info | {"blas": blas_name(info.get("blas"))},
                               "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
