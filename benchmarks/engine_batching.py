"""batchscope's engine vs mlx-lm's batch_generate vs serial generation, in one run.

Same model, weights and prompts for all three; for each concurrency C, C prompts of varied
length are generated (greedy, --max-tokens each). Reports aggregate prefill and decode tokens/s
and their ratios against batch_generate measured in the same run, plus the share of engine step
time spent outside the model forward.

Prefill and decode are measured the same way for all three, from whole calls on the wall
clock, so that no system's own accounting decides what counts as which:
- prefill: a call with max_tokens=1 (every prompt in, every first token out);
- decode: a call with max_tokens=N+1; its extra time over the first call, for its extra tokens.
A split at "the moment the first tokens come back" is not fair: batch_generate launches its
next step before it returns a step's tokens (pipelining), so such a split gives it a head start
of up to one step (~3% of 32). Its own counters differ again (the last prompt token and its
logits count as decode; the caller's time between steps is left out), and so do the engine's
step records; both are kept in the JSON ("self_reported"). No system stops at EOS here: every
request generates exactly max_tokens.

    .venv/bin/python benchmarks/engine_batching.py [--weights auto] [--concurrency 1 4 8 16]
        [--repeats 3]

With --repeats N each concurrency runs N interleaved rounds (engine, batch_generate, serial,
again); the table gives each rate's median over the rounds, the median of the per-round
ratios, and the range of the decode ratio, since one round on a shared machine can be well off
the others (the bracketed ranges in benchmarks/results/engine_batching.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.model_loader import load_model
from engine.platform import backend_info, blas_name, blas_text
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


def run_serial(model, prompts, max_tokens) -> dict:
    t0 = time.perf_counter()
    generated = 0
    for ids in prompts:  # one request after another
        generated += sum(1 for _ in generate_step(mx.array(ids), model, max_tokens=max_tokens))
    return {"generated": generated, "wall": time.perf_counter() - t0}


def run_batch_generate(model, tokenizer, prompts, max_tokens) -> dict:
    """mlx-lm's batch_generate loop (a BatchGenerator, responses until all finish), without
    stop tokens so that every request generates max_tokens, as in the other two."""
    t0 = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert(prompts, [max_tokens] * len(prompts))
    generated = 0
    with gen.stats() as s:
        while responses := gen.next_generated():
            generated += len(responses)
    gen.close()
    return {"generated": generated, "wall": time.perf_counter() - t0,
            "self_reported": {"prompt_tokens": s.prompt_tokens, "prompt_time": s.prompt_time,
                              "generation_tokens": s.generation_tokens,
                              "decode_time": s.decode_time}}


def run_engine(eng: Engine, prompts, max_tokens) -> dict:
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
    return {"generated": sum(r.completion_tokens for r in results), "wall": wall,
            "self_reported": {"prefill_rows": sum(r.prefill_rows for r in prefill),
                              "prefill_steps_time": sum(r.wall_time for r in prefill),
                              "decode_rows": sum(r.decode_rows for r in decode),
                              "decode_steps_time": sum(r.wall_time for r in decode)},
            "mixed_steps": len(steps) - len(prefill) - len(decode),
            "outside_model": sum(r.scheduler_time for r in steps) / sum(r.wall_time for r in steps)}


def measure(run, prompts, max_tokens: int, attempts: int = 3) -> dict:
    """Prefill from a max_tokens=1 call, decode from the extra time of a max_tokens+1 call.

    A pair whose full call is not the longer (a first call that compiled kernels, a GPU's JIT,
    or a burst of other work on a shared machine) leaves no decode time: the pair is measured
    again, up to `attempts` pairs, then refused rather than reported as a negative rate."""
    for _ in range(attempts):
        first = run(prompts, 1)
        full = run(prompts, max_tokens + 1)
        assert first["generated"] == len(prompts), first
        assert full["generated"] == len(prompts) * (max_tokens + 1), full
        if full["wall"] > first["wall"]:
            break
    else:
        raise RuntimeError(f"the max_tokens=1 call took {first['wall']:.2f} s, the "
                           f"max_tokens={max_tokens + 1} call {full['wall']:.2f} s (the last "
                           f"of {attempts} pairs): no decode time is left to measure (was the "
                           "warm-up short?)")
    return full | {"prompt_tokens": sum(map(len, prompts)), "prefill_time": first["wall"],
                   "decode_tokens": full["generated"] - first["generated"],
                   "decode_time": full["wall"] - first["wall"], "first_call": first}


def rates(m: dict) -> dict:
    return {"prefill_tps": m["prompt_tokens"] / m["prefill_time"],
            "decode_tps": m["decode_tokens"] / m["decode_time"],
            "overall_tps": m["generated"] / m["wall"]}


RATES = ("prefill_tps", "decode_tps", "overall_tps")


def summarize(c: int, rounds: list[dict]) -> dict:
    """One concurrency's rounds -> median rates per system and the per-round ratios."""
    row = {"concurrency": c, "rounds": rounds}
    for system in ("engine", "batch_generate", "serial"):
        row[system] = {k: statistics.median(r[system][k] for r in rounds) for k in RATES}
    row["engine"]["outside_model"] = statistics.median(r["engine"]["outside_model"]
                                                       for r in rounds)
    row["engine"]["mixed_steps"] = max(r["engine"]["mixed_steps"] for r in rounds)
    row["ratios"] = {}
    for k in RATES:
        per_round = [r["engine"][k] / r["batch_generate"][k] for r in rounds]
        row["ratios"][k] = {"median": statistics.median(per_round), "min": min(per_round),
                            "max": max(per_round)}
    return row


def render_table(rows, model, weights, info, max_tokens) -> str:
    lines = [
        f"Model {model}, weights {weights}, backend {info['backend']}, BLAS "
        f"{'OpenBLAS' if info.get('blas') else 'bundled reference'}; prompts of 20-120 "
        f"tokens, greedy; prefill from a 1-token call, decode from the extra time of a "
        f"{max_tokens + 1}-token call; medians of {len(rows[0]['rounds'])} "
        "interleaved rounds. Ratios are engine / batch_generate (median of the rounds' ratios; "
        "decode: lowest-highest round in brackets).",
        "",
        "| requests | decode tok/s: engine | batch_generate | serial | ratio "
        "| prefill tok/s: engine | batch_generate | serial | ratio "
        "| overall tok/s: engine | batch_generate | ratio | engine time outside forward |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e, b, s, q = r["engine"], r["batch_generate"], r["serial"], r["ratios"]
        d = q["decode_tps"]
        lines.append(
            f"| {r['concurrency']} | {e['decode_tps']:.1f} | {b['decode_tps']:.1f} | "
            f"{s['decode_tps']:.1f} | {d['median']:.2f}x ({d['min']:.2f}-{d['max']:.2f}) | "
            f"{e['prefill_tps']:.0f} | {b['prefill_tps']:.0f} | {s['prefill_tps']:.0f} | "
            f"{q['prefill_tps']['median']:.2f}x | {e['overall_tps']:.1f} | "
            f"{b['overall_tps']:.1f} | {q['overall_tps']['median']:.2f}x | "
            f"{e['outside_model'] * 100:.1f}% |")
    return "\n".join(lines)


def engine_config(weights: str, concurrency: list[int]) -> EngineConfig:
    """The engine set-up of this comparison: room for the largest concurrency in one step."""
    max_c = max(concurrency)
    return EngineConfig(weights=weights, max_num_seqs=max_c,
                        max_num_batched_tokens=max(512, 130 * max_c), num_kv_blocks=1024,
                        enable_prefix_caching=False)


def compare(eng: Engine, loaded, concurrency: list[int], max_tokens: int, repeats: int = 1,
            log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """Warm up, then for each concurrency C, `repeats` rounds of engine, batch_generate and
    serial on C prompts. `loaded` is the same model (and weights) as the engine's, loaded on
    this thread."""
    warm = make_prompts(loaded.tokenizer, 2)
    run_engine(eng, warm, 4)
    run_batch_generate(loaded.model, loaded.tokenizer, warm, 4)
    run_serial(loaded.model, warm[:1], 4)

    rows = []
    for c in concurrency:
        prompts = make_prompts(loaded.tokenizer, c)
        # Untimed, at this batch's shapes: a GPU backend compiles kernels on first use.
        run_engine(eng, prompts, 2)
        run_batch_generate(loaded.model, loaded.tokenizer, prompts, 2)
        rounds = []
        for i in range(repeats):
            log(f"# concurrency {c}, round {i + 1}/{repeats}: engine, batch_generate, serial...")
            e = measure(lambda p, n: run_engine(eng, p, n), prompts, max_tokens)
            b = measure(lambda p, n: run_batch_generate(loaded.model, loaded.tokenizer, p, n),
                        prompts, max_tokens)
            s = measure(lambda p, n: run_serial(loaded.model, p, n), prompts, max_tokens)
            rounds.append({"engine": {**e, **rates(e)}, "batch_generate": {**b, **rates(b)},
                           "serial": {**s, **rates(s)}})
            ratio = rates(e)["decode_tps"] / rates(b)["decode_tps"]
            log(f"#   decode: engine / batch_generate {ratio:.2f}x")
        rows.append(summarize(c, rounds))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds per concurrency")
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
          f"BLAS {blas_text(info)}", file=sys.stderr)
    rows = compare(eng, loaded, args.concurrency, args.max_tokens, args.repeats)
    eng.stop()

    table = render_table(rows, loaded.name, loaded.weights, info, args.max_tokens)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    backend = info | {"blas": blas_name(info.get("blas"))}
    out.write_text(json.dumps({"weights": loaded.weights, "backend": backend, "rows": rows},
                              indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
