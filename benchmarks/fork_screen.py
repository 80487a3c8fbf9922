"""Screen many chat prompts for greedy forks between "alone" and "alongside" numerics, fast.

`batchscope diverge --search` runs each prompt alone on both sides, one at a time. This screen
runs 16 prompts at once in each of two engines and compares their greedy tokens:

  A: --kernel-policy auto, threshold 16: the prefill step (hundreds of rows) uses one GEMM, the
     16-row decode steps go row-wise (GEMV), as each request's decode steps do when it runs
     alone under auto with T = 1.
  B: --kernel-policy gemm: every step is one batched GEMM, as when it shares its steps.
     With --row-kernels mlx (the default here) that GEMM is MLX's (the BLAS); with auto, the
     decode steps take the native kernel, which gives each row its alone-bits, so only the
     prefill step differs from A.

A prompt whose tokens differ is a candidate; confirm it with `batchscope diverge` (alone vs
alongside 15 others), which also gives the logits at the fork and the cache-contamination trace.
With float32 + OpenBLAS the two sides differ by ~3e-5 in the logits, so only a near-tie forks:
on the development machine, with the native attention kernel, all 240 prompts x 160 tokens
(38400 tokens a side) gave 1 fork (docs/divergence-fork.md).

    .venv/bin/python benchmarks/fork_screen.py [--count 128] [--max-tokens 160] [--weights f32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.sampling import SamplingParams

SUBJECTS = ["a lighthouse", "the moon", "a lost cat", "winter", "a robot", "coffee", "the ocean",
            "a library", "trains", "volcanoes", "a dragon", "friendship", "rain", "a garden",
            "mountains", "time travel", "a city at night", "bees", "chess", "the desert",
            "an old clock", "a river", "snow", "music", "a forest", "stars", "a bakery",
            "bicycles", "a storm", "a painter", "the wind", "a castle", "butterflies", "a map",
            "a violin", "autumn leaves", "a spaceship", "tea", "a whale", "a market"]
TEMPLATES = ["Write a short poem about {}.", "Tell me a very short story about {}.",
             "Give me five surprising facts about {}.", "Describe {} in three sentences.",
             "Write a haiku about {}.", "Invent a name and a backstory for {}."]
BATCH = 16


def prompts(start: int, count: int) -> list[str]:
    every = [t.format(s) for s, t in itertools.product(SUBJECTS, TEMPLATES)]
    return every[start:start + count]


def generate(texts: list[str], weights: str, policy: str, threshold: int | None,
             max_tokens: int, row_kernels: str) -> list[list[int]]:
    config = EngineConfig(weights=weights, kernel_policy=policy, kernel_threshold=threshold,
                          max_num_seqs=BATCH, max_num_batched_tokens=4096, num_kv_blocks=1024,
                          enable_prefix_caching=False, row_kernels=row_kernels)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out: list[list[int]] = []
    with Engine(config).start() as eng:
        for i in range(0, len(texts), BATCH):
            ids = [eng.encode_chat([{"role": "user", "content": t}]) for t in texts[i:i + BATCH]]
            handles = eng.submit_many([Submission(x, params) for x in ids])  # one prefill step
            out += [h.result().token_ids for h in handles]
            print(f"# {policy}: {len(out)}/{len(texts)} prompts", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--start", type=int, default=0, help="first prompt of the built-in list")
    ap.add_argument("--count", type=int, default=128, help=f"prompts (of {len(prompts(0, 10**6))})")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--row-kernels", "--decode-matmul", dest="row_kernels", default="mlx",
                    choices=["auto", "mlx"], help="the engine's --row-kernels (old name: "
                    "--decode-matmul)")
    args = ap.parse_args()
    texts = prompts(args.start, args.count)
    t0 = time.perf_counter()
    alone = generate(texts, args.weights, "auto", BATCH, args.max_tokens, args.row_kernels)
    t1 = time.perf_counter()
    shared = generate(texts, args.weights, "gemm", None, args.max_tokens, args.row_kernels)
    t2 = time.perf_counter()
    forks = []
    for text, a, b in zip(texts, alone, shared, strict=True):
        if a != b:
            index = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            forks.append({"prompt": text, "token_index": index})
    print(json.dumps({"prompts": len(texts), "tokens_per_side": sum(map(len, alone)),
                      "weights": args.weights, "row_kernels": args.row_kernels,
                      "seconds_a": round(t1 - t0, 1),
                      "seconds_b": round(t2 - t1, 1), "forks": forks}, indent=1))
    for f in forks:
        print(f"confirm: batchscope diverge {json.dumps(f['prompt'])} --chat --weights "
              f"{args.weights} --max-tokens {args.max_tokens} --a policy=auto,threshold=1 "
              f"--b policy=auto,threshold=1,row_kernels={args.row_kernels},alongside=40,35,30,45,"
              f"50,38,42,33,47,36,44,39,41,37,43,others_tokens={args.max_tokens}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
