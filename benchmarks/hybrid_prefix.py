"""Prefix caching on a hybrid model: the TTFT of a request whose long prefix an earlier request
computed (warm: it resumes from the deepest recurrent-state checkpoint) against the same
request on an engine without prefix caching (cold).

    .venv/bin/python benchmarks/hybrid_prefix.py [--family qwen3_5-135m] [--weights q4]
        [--prefix 2000] [--suffix 16] [--rounds 3] [--intervals 256]

Each round draws a fresh random prefix of --prefix token ids (so no round finds another's
cache) and two distinct --suffix-token endings. On the caching engine, request A (prefix +
ending A) runs first and leaves the prefix's blocks and its state checkpoints (every
--state-checkpoint-interval tokens) behind; request B (prefix + ending B) is then the warm one.
B also runs on an engine with prefix caching off: the cold one. Both engines hold the same
folder (benchmarks/families.py's random-weight configs) and take turns. A GDN layer's state
exists only at checkpoint positions, so B resumes at the deepest multiple of the interval at or
below the shared length and recomputes the rest: the cached tokens each request reports
(FinishEvent.cached_prompt_tokens) are recorded. TTFT is the engine's own stamps: first token
time minus arrival time, one output token per request. With several --intervals, one caching
engine per interval. Writes benchmarks/results/hybrid_prefix[_WEIGHTS].md and .json.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
from families import CONFIGS, make_folder
from llama_cpp_peer import log
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.platform import backend_info, blas_name
from engine.sampling import SamplingParams


def ttft(eng: Engine, ids: list[int]) -> dict:
    """One greedy token for `ids`: its TTFT from the engine's stamps and the cached tokens."""
    handle = eng.submit_many([Submission(ids, SamplingParams(max_tokens=1, ignore_eos=True))])[0]
    finish = handle.result()
    return {"ttft_s": finish.first_token_time - finish.arrival_time,
            "cached": finish.cached_prompt_tokens, "prompt": finish.prompt_tokens}


def random_ids(rng: random.Random, n: int) -> list[int]:
    # Ordinary vocabulary ids: the embedded tokenizer's special tokens are the first few.
    return [rng.randrange(100, 49000) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_5-135m", choices=sorted(CONFIGS))
    ap.add_argument("--weights", default="q4", choices=["q4", "f32"])
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--intervals", type=int, nargs="+", default=[256],
                    help="state_checkpoint_interval of each caching engine")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    length = args.prefix + args.suffix
    base = {"weights": args.weights, "max_num_seqs": 2, "max_model_len": length + 16}
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_folder(Path(tmp), args.family, args.weights))
        cold = Engine(EngineConfig(model=folder, enable_prefix_caching=False, **base)).start()
        warm = {i: Engine(EngineConfig(model=folder, state_checkpoint_interval=i, **base)).start()
                for i in args.intervals}
        try:
            rng = random.Random(0)
            for eng in (cold, *warm.values()):  # warm-up: every shape of step once
                ttft(eng, random_ids(rng, length))
            rounds = []
            for r in range(args.rounds):
                prefix = random_ids(rng, args.prefix)
                a = prefix + random_ids(rng, args.suffix)
                b = prefix + random_ids(rng, args.suffix)
                row = {"cold": ttft(cold, b), "warm": {}}
                for i, eng in warm.items():
                    first = ttft(eng, a)
                    row["warm"][i] = {"first": first, "second": ttft(eng, b)}
                rounds.append(row)
                log(f"round {r + 1}/{args.rounds}: cold {row['cold']['ttft_s']:.3f} s; "
                    + ", ".join(
                    f"interval {i}: first {w['first']['ttft_s']:.3f} s, second "
                    f"{w['second']['ttft_s']:.3f} s ({w['second']['cached']} cached)"
                    for i, w in row["warm"].items()))
        finally:
            for eng in (cold, *warm.values()):
                eng.stop()
    info = backend_info()
    shown = [a for i, a in enumerate(argv)  # where the files go is not part of the run
             if a != "--out-dir" and (i == 0 or argv[i - 1] != "--out-dir")]
    cold_s = statistics.median(r["cold"]["ttft_s"] for r in rounds)
    rows = []
    for i in args.intervals:
        second = [r["warm"][i]["second"] for r in rounds]
        rows.append({
            "interval": i, "cold_ttft_s": cold_s,
            "first_ttft_s": statistics.median(r["warm"][i]["first"]["ttft_s"] for r in rounds),
            "warm_ttft_s": statistics.median(s["ttft_s"] for s in second),
            "speedup": statistics.median(r["cold"]["ttft_s"] / r["warm"][i]["second"]["ttft_s"]
                                         for r in rounds),
            "cached": sorted({s["cached"] for s in second}),
            "cold_cached": sorted({r["cold"]["cached"] for r in rounds})})
    data = {"command": shlex.join([".venv/bin/python", "benchmarks/hybrid_prefix.py", *shown]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": info["backend"],
            "blas": blas_name(info.get("blas")) or "bundled", "family": args.family,
            "weights": args.weights, "prefix": args.prefix, "suffix": args.suffix,
            "chunk": EngineConfig().max_num_batched_tokens, "rows": rows, "rounds": rounds}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "hybrid_prefix" + ("" if args.weights == "q4" else f"_{args.weights}")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0


def render(data: dict) -> str:
    lines = [
        "# Prefix caching on a hybrid model: TTFT from a state checkpoint", "",
        f"`{data['command']}`, run {data['started']}: backend {data['backend']}, BLAS "
        f"{data['blas']}; {data['family']} ({data['weights']}, random weights), a "
        f"{data['prefix']}-token shared prefix and a {data['suffix']}-token distinct ending, "
        f"prefill chunks of {data['chunk']} tokens; medians of {len(data['rounds'])} rounds, "
        "each with a fresh prefix. Cold: the second request on an engine without prefix "
        "caching. First: the first request on the caching engine (it takes the checkpoints). "
        "Warm: the second request there, resumed from the deepest checkpoint.", "",
        "| checkpoint interval | cold TTFT s | first TTFT s | warm TTFT s | cold / warm "
        "| cached tokens (warm) | cached tokens (cold) |",
        "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['interval']} | {r['cold_ttft_s']:.3f} | {r['first_ttft_s']:.3f} | "
                     f"{r['warm_ttft_s']:.3f} | {r['speedup']:.1f}x | "
                     f"{', '.join(map(str, r['cached']))} | "
                     f"{', '.join(map(str, r['cold_cached']))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
