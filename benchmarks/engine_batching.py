"""batchscope's engine vs mlx-lm's batch_generate vs serial generation, in one run.

Same model, weights and prompts for all three; for each concurrency C, C prompts of varied
length are generated (greedy, --max-tokens each). Reports aggregate prefill and decode tokens/s
and their ratios against batch_generate measured in the same run, plus the share of engine step
time spent outside the model forward.

    .venv/bin/python benchmarks/engine_batching.py [--weights auto] [--concurrency 1 4 8 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.model_loader import load_model
from engine.platform import backend_info
from engine.sampling import SamplingParams

TEXT = ("Continuous batching lets an inference server add and remove requests at every step, "
        "so the accelerator never waits for the slowest request of a static batch. The KV cache "
        "is split into fixed-size blocks, and each request keeps a table of the blocks holding "
        "its keys and values. When memory runs out, the newest request is preempted and later "
        "recomputed. Prefix caching lets requests that share a system prompt reuse its blocks. ")


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts of 20..120 tokens, each with a distinct first word (no prefix sharing)."""
    words = (TEXT * 4).split()
    prompts = []
    for i in range(n):
        length = 20 + (i * 37) % 100
        ids = tokenizer.encode(f"Request {i}: " + " ".join(words[i:i + length]))
        prompts.append(ids[:length])
    return prompts


def run_serial(model, prompts, max_tokens):
    prefill_time = decode_time = 0.0
    generated = 0
    for ids in prompts:
        t0 = time.perf_counter()
        steps = generate_step(mx.array(ids), model, max_tokens=max_tokens)
        next(steps)
        t1 = time.perf_counter()
        n = 1 + sum(1 for _ in steps)
        prefill_time += t1 - t0
        decode_time += time.perf_counter() - t1
        generated += n
    return {"prompt_tokens": sum(map(len, prompts)), "prefill_time": prefill_time,
            "generated": generated, "decode_tokens": generated - len(prompts),
            "decode_time": decode_time, "wall": prefill_time + decode_time}


def run_batch_generate(model, tokenizer, prompts, max_tokens):
    t0 = time.perf_counter()
    result = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens)
    wall = time.perf_counter() - t0
    s = result.stats
    return {"prompt_tokens": s.prompt_tokens, "prefill_time": s.prompt_time,
            "generated": s.generation_tokens, "decode_tokens": s.generation_tokens,
            "decode_time": s.decode_time, "wall": wall}


def run_engine(eng: Engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first_step = eng.step_count + 1
    t0 = time.perf_counter()
    # All at once, like batch_generate's list: submitted one by one, the first could start
    # its prefill alone before the others arrive.
    handles = eng.submit_many([Submission(ids, params) for ids in prompts])
    results = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    steps = [r for r in eng.steps.recent() if r.step >= first_step]
    prefill = [r for r in steps if r.prefill_rows and not r.decode_rows]
    decode = [r for r in steps if r.decode_rows and not r.prefill_rows]
    return {"prompt_tokens": sum(r.prefill_rows for r in prefill),
            "prefill_time": sum(r.wall_time for r in prefill),
            "generated": sum(r.completion_tokens for r in results),
            "decode_tokens": sum(r.decode_rows for r in decode),
            "decode_time": sum(r.wall_time for r in decode), "wall": wall,
            "mixed_steps": len(steps) - len(prefill) - len(decode),
            "outside_model": sum(r.scheduler_time for r in steps) / sum(r.wall_time for r in steps)}


def rates(m: dict) -> dict:
    return {"prefill_tps": m["prompt_tokens"] / m["prefill_time"],
            "decode_tps": m["decode_tokens"] / m["decode_time"],
            "overall_tps": m["generated"] / m["wall"]}


def render_table(rows, model, weights, info, max_tokens) -> str:
    lines = [
        f"Model {model}, weights {weights}, backend {info['backend']}, BLAS "
        f"{'OpenBLAS' if info.get('blas') else 'bundled reference'}; {max_tokens} new tokens "
        "per request, prompts of 20-120 tokens, greedy. Ratios are engine / batch_generate.",
        "",
        "| requests | decode tok/s: engine | batch_generate | serial | ratio "
        "| prefill tok/s: engine | batch_generate | serial | ratio "
        "| overall tok/s: engine | batch_generate | ratio | engine time outside forward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, b, s = r["engine"], r["batch_generate"], r["serial"]
        lines.append(
            f"| {r['concurrency']} | {e['decode_tps']:.1f} | {b['decode_tps']:.1f} | "
            f"{s['decode_tps']:.1f} | {e['decode_tps'] / b['decode_tps']:.2f}x | "
            f"{e['prefill_tps']:.0f} | {b['prefill_tps']:.0f} | {s['prefill_tps']:.0f} | "
            f"{e['prefill_tps'] / b['prefill_tps']:.2f}x | {e['overall_tps']:.1f} | "
            f"{b['overall_tps']:.1f} | {e['overall_tps'] / b['overall_tps']:.2f}x | "
            f"{e['outside_model'] * 100:.1f}% |")
    return "\n".join(lines)


def engine_config(weights: str, concurrency: list[int]) -> EngineConfig:
    """The engine set-up of this comparison: room for the largest concurrency in one step."""
    max_c = max(concurrency)
    return EngineConfig(weights=weights, max_num_seqs=max_c,
                        max_num_batched_tokens=max(512, 130 * max_c), num_kv_blocks=1024,
                        enable_prefix_caching=False)


def compare(eng: Engine, loaded, concurrency: list[int], max_tokens: int,
            log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """Warm up, then for each concurrency C: engine, batch_generate and serial on C prompts.
    `loaded` is the same model (and weights) as the engine's, loaded on this thread."""
    warm = make_prompts(loaded.tokenizer, 2)
    run_engine(eng, warm, 4)
    run_batch_generate(loaded.model, loaded.tokenizer, warm, 4)
    run_serial(loaded.model, warm[:1], 4)

    rows = []
    for c in concurrency:
        prompts = make_prompts(loaded.tokenizer, c)
        log(f"# concurrency {c}: engine...")
        e = run_engine(eng, prompts, max_tokens)
        log(f"# concurrency {c}: batch_generate...")
        b = run_batch_generate(loaded.model, loaded.tokenizer, prompts, max_tokens)
        log(f"# concurrency {c}: serial...")
        s = run_serial(loaded.model, prompts, max_tokens)
        rows.append({"concurrency": c, "engine": {**e, **rates(e)},
                     "batch_generate": {**b, **rates(b)}, "serial": {**s, **rates(s)}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/engine_batching.json")
    ap.add_argument("--render", action="store_true", help="only re-print the table of --out")
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.out).read_text())
        print(render_table(data["rows"], "SmolLM2-135M-Instruct", data["weights"],
                           data["backend"], args.max_tokens))
        return 0

    eng = Engine(engine_config(args.weights, args.concurrency)).start()
    # The reference runs use the same weights object, loaded on this thread for mlx-lm.
    loaded = load_model("embedded", eng.loaded.weights)
    info = backend_info()
    print(f"# model {loaded.name}, weights {loaded.weights}, backend {info['backend']}, "
          f"BLAS {info.get('blas') or 'bundled'}", file=sys.stderr)
    rows = compare(eng, loaded, args.concurrency, args.max_tokens)
    eng.stop()

    table = render_table(rows, loaded.name, loaded.weights, info, args.max_tokens)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"weights": loaded.weights, "backend": info, "rows": rows},
                              indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
