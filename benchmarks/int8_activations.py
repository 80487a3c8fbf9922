"""--activations int8 against float32 on the shipped 4-bit weights: speed and agreement, one run.

Speed: for each concurrency C, C requests (prompts of 20-120 tokens, engine_batching.py's)
on an engine with float32 activations and on one with int8 ones, in interleaved rounds (each
goes first in every other round, so drift on a shared machine hits both); prefill from a
max_tokens=1 call and decode from the extra time of a longer one (engine_batching.measure).
Medians of the rounds and the median of the per-round ratios.

Agreement: on the reference prompts (engine.testing.REFERENCE_PROMPTS), each engine's greedy
ids against mlx-lm's own generation on the exported folder (its quantized_matmul, float
activations): how many tokens agree before the first difference, and the largest
|logprob - mlx-lm's logprob| of the chosen tokens up to there.

    .venv/bin/python benchmarks/int8_activations.py [--concurrency 1 4 8 16] [--rounds 3]
"""

from __future__ import annotations

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on

import argparse
import json
import statistics
import sys
from pathlib import Path

from engine import native
from engine.config import EngineConfig
from engine.engine import Engine
from engine.platform import backend_info
from engine.sampling import SamplingParams
from engine.testing import REFERENCE_PROMPTS, mlx_lm_greedy

sys.path.insert(0, str(Path(__file__).parent))
from engine_batching import make_prompts, measure, rates, run_engine  # noqa: E402

MODES = ("float32", "int8")


def speed(engines: dict[str, Engine], args) -> list[dict]:
    rows = []
    for c in args.concurrency:
        prompts = make_prompts(engines["float32"].tokenizer, c)
        rounds: dict[str, list[dict]] = {m: [] for m in MODES}
        for rnd in range(args.rounds):
            for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                print(f"# {c} requests, round {rnd + 1}, {mode} activations...",
                      file=sys.stderr, flush=True)
                eng = engines[mode]
                rounds[mode].append(rates(measure(lambda p, n, e=eng: run_engine(e, p, n),
                                                  prompts, args.max_tokens)))
        row = {"concurrency": c, "rounds": rounds}
        for key in ("prefill_tps", "decode_tps"):
            for mode in MODES:
                row[f"{mode}_{key}"] = statistics.median(r[key] for r in rounds[mode])
            row[f"{key}_ratio"] = statistics.median(
                b[key] / a[key] for a, b in zip(rounds["float32"], rounds["int8"], strict=True))
        rows.append(row)
    return rows


def agreement(engines: dict[str, Engine], max_tokens: int) -> list[dict]:
    tokenizer, generate = mlx_lm_greedy("q4")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    rows = []
    for prompt in REFERENCE_PROMPTS:
        ids = tokenizer.encode(prompt)
        ref_ids, ref_logprobs = generate(ids, max_tokens)
        row = {"prompt": prompt}
        for mode in MODES:
            print(f"# agreement: {prompt!r}, {mode}...", file=sys.stderr, flush=True)
            handle = engines[mode].submit(ids, params)
            tokens = [e for e in handle if hasattr(e, "logprob")]
            ours = [e.token_id for e in tokens]
            same = next((i for i, (a, b) in enumerate(zip(ours, ref_ids, strict=True)) if a != b),
                        len(ours))
            upto = min(same + 1, len(ours))
            row[mode] = {"agree": same, "of": len(ours), "max_dlogprob": max(
                abs(tokens[i].logprob - float(ref_logprobs[i][ours[i]])) for i in range(upto))}
        rows.append(row)
    return rows


def render(speed_rows, agree_rows, args) -> str:
    info = backend_info()
    lines = [f"`--activations int8` against float32 on the embedded model's 4-bit weights, "
             f"backend {info['backend']}, int8 path {native.int8_activations_isa()}, float32 "
             f"path {native.decode_quantized_isa()}; {args.max_tokens} new tokens per request, "
             f"medians of {args.rounds} interleaved rounds.", "",
             "| requests | decode tok/s float32 | decode tok/s int8 | int8 / float32 | "
             "prefill tok/s float32 | prefill tok/s int8 | int8 / float32 |",
             "|---|---|---|---|---|---|---|"]
    for r in speed_rows:
        lines.append(f"| {r['concurrency']} | {r['float32_decode_tps']:.1f} | "
                     f"{r['int8_decode_tps']:.1f} | {r['decode_tps_ratio']:.2f}x | "
                     f"{r['float32_prefill_tps']:.0f} | {r['int8_prefill_tps']:.0f} | "
                     f"{r['prefill_tps_ratio']:.2f}x |")
    lines += ["", f"Agreement with mlx-lm's own greedy generation ({args.agree_tokens} tokens, "
              "ids equal up to the first difference; max |Δlogprob| of the chosen tokens up to "
              "and including it):", "",
              "| prompt | float32: same ids | float32: max abs Δlogprob | int8: same ids | "
              "int8: max abs Δlogprob |", "|---|---|---|---|---|"]
    for r in agree_rows:
        f, i = r["float32"], r["int8"]
        lines.append(f"| {r['prompt']} | {f['agree']}/{f['of']} | {f['max_dlogprob']:.1e} | "
                     f"{i['agree']}/{i['of']} | {i['max_dlogprob']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/int8_activations.json")
    args = ap.parse_args()
    base = dict(weights="q4", max_num_seqs=max(args.concurrency), num_kv_blocks=1024,
                max_num_batched_tokens=512, enable_prefix_caching=False)
    engines = {m: Engine(EngineConfig(**base, activations=m)).start() for m in MODES}
    try:
        agree_rows = agreement(engines, args.agree_tokens)
        speed_rows = speed(engines, args)
    finally:
        for eng in engines.values():
            eng.stop()
    table = render(speed_rows, agree_rows, args)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"speed": speed_rows, "agreement": agree_rows}, indent=2))
    out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
