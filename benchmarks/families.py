"""Decode speed of every supported model family: the engine against mlx-lm's batch_generate on
the same tiny random-weight folder, in one run.

For each family a small folder is made with mlx-lm's own classes (engine.testing), loaded by
both systems with the same weights, and measured as benchmarks/engine_batching.py measures:
decode tokens/s from the extra time of a max_tokens=N+1 call over a max_tokens=1 call, at 1 and
8 concurrent requests, the two systems interleaved per round. The ratio is engine /
batch_generate, the median of the rounds' ratios.

    .venv/bin/python benchmarks/families.py [--families llama qwen3 ...] [--weights f32]
        [--concurrency 1 8] [--repeats 3]

These are the test suite's tiny models (engine.testing.FAMILY_CONFIGS: hidden 64-128, 2-6
layers, the embedded tokenizer's 49152-token vocabulary), so the numbers say more about
per-step overhead and the lm_head than about a real model's weights; the embedded model's
numbers are engine_batching.py's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
from engine_batching import make_prompts, measure, rates, run_batch_generate, run_engine
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_loader import load_folder
from engine.platform import backend_info, blas_name
from engine.testing import FAMILY_CONFIGS, make_family_folder


def bench_family(name: str, root: Path, weights: str, concurrency: list[int], max_tokens: int,
                 repeats: int) -> dict:
    module_name, config = FAMILY_CONFIGS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    folder = make_family_folder(root / name, module, config,
                                quantize=weights == "q4")
    engine_weights = "q4" if weights == "q4" else weights
    eng = Engine(EngineConfig(model=str(folder), weights=engine_weights,
                              max_num_seqs=max(concurrency), num_kv_blocks=512,
                              max_num_batched_tokens=max(512, 130 * max(concurrency)),
                              enable_prefix_caching=False)).start()
    loaded = load_folder(folder, engine_weights)  # the same weights, on this thread for mlx-lm
    warm = make_prompts(loaded.tokenizer, 2)
    run_engine(eng, warm, 4)
    run_batch_generate(loaded.model, loaded.tokenizer, warm, 4)
    rows = []
    for c in concurrency:
        prompts = make_prompts(loaded.tokenizer, c)
        ratios, engine_tps, mlx_tps = [], [], []
        for _ in range(repeats):
            e = rates(measure(lambda p, n: run_engine(eng, p, n), prompts, max_tokens))
            b = rates(measure(lambda p, n: run_batch_generate(loaded.model, loaded.tokenizer,
                                                              p, n), prompts, max_tokens))
            engine_tps.append(e["decode_tps"])
            mlx_tps.append(b["decode_tps"])
            ratios.append(e["decode_tps"] / b["decode_tps"])
        rows.append({"concurrency": c, "engine_decode_tps": statistics.median(engine_tps),
                     "batch_generate_decode_tps": statistics.median(mlx_tps),
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios),
                                                                          max(ratios)]})
        print(f"# {name} at {c}: engine {rows[-1]['engine_decode_tps']:.0f} tok/s, "
              f"batch_generate {rows[-1]['batch_generate_decode_tps']:.0f} tok/s, "
              f"{rows[-1]['ratio']:.2f}x", file=sys.stderr, flush=True)
    eng.stop()
    return {"family": name, "weights": loaded.weights, "rows": rows}


def render_table(results: list[dict], concurrency: list[int], info: dict, max_tokens: int,
                 repeats: int) -> str:
    head = " | ".join(f"{c} req: engine | batch_generate | ratio" for c in concurrency)
    lines = [
        f"Decode tok/s on the tiny random-weight folders of engine.testing.FAMILY_CONFIGS, "
        f"{max_tokens} new tokens per request, median of {repeats} interleaved rounds; "
        f"backend {info['backend']}, "
        f"BLAS {blas_name(info.get('blas')) or 'bundled'}. Command: "
        f"`.venv/bin/python benchmarks/families.py --repeats {repeats}`.",
        "", f"| family | weights | {head} |",
        "|---|---|" + "---|---|---|" * len(concurrency)]
    for r in results:
        cells = " | ".join(f"{x['engine_decode_tps']:.0f} | {x['batch_generate_decode_tps']:.0f}"
                           f" | {x['ratio']:.2f}x" for x in r["rows"])
        lines.append(f"| {r['family']} | {r['weights']} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", nargs="+", default=sorted(FAMILY_CONFIGS))
    ap.add_argument("--weights", default="f32", choices=["f32", "q4"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/families.json")
    args = ap.parse_args()
    unknown = sorted(set(args.families) - set(FAMILY_CONFIGS))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(sorted(FAMILY_CONFIGS))}")
    info = backend_info()
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            results.append(bench_family(name, Path(tmp), args.weights, args.concurrency,
                                        args.max_tokens, args.repeats))
    table = render_table(results, args.concurrency, info, args.max_tokens, args.repeats)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"backend": info | {"blas": blas_name(info.get("blas"))},
                               "results": results}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')} in {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
