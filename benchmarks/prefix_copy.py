"""A repeated prompt's first token: its last block's rows copied, against computed again.

A prompt sent a second time matches its whole blocks in the prefix cache; the tokens after them
(the tail: 1 to 16 of them) are either copied from the first request's last block, all but the
last (engine/block_manager.py's copy_partial; here at any number of rows), by the native op
(engine/native/pool_copy.h: the engine's copy on the CPU, from ROWS_WORTH_COPYING_NATIVE rows
on) or by MLX's gather and scatter per layer (KVPool.copy_rows without the op: the path GPU
backends take, from ROWS_WORTH_COPYING rows on), or computed again in the request's first step
(the engine before the copy). Three engines in this process, one of each, on the same model:
for each tail length, a prompt of --context + tail tokens is sent once (cold) and then again;
the second request's time (max_tokens 1: its prefill step and the sampled token) is what the
table gives, each engine measured in turn, the order rotating by round, medians over --rounds,
with the time of its copy alone (the pool's copy_rows call on the engine thread). Every prompt
has a distinct first word, so the second request's whole blocks are its own first run's (that
cold run may copy the first tokens its first block shares with an earlier prompt's).

    .venv/bin/python benchmarks/prefix_copy.py [--weights auto] [--context 160]
        [--tails 2 3 4 5 8 12 15] [--rounds 5]

Writes benchmarks/results/prefix_copy.{md,json} unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import ROWS_WORTH_COPYING, ROWS_WORTH_COPYING_NATIVE
from engine.platform import backend_info
from engine.sampling import SamplingParams

HERE = Path(__file__).parent
WORDS = ("Continuous batching lets an inference server add and remove requests at every step, "
         "so the accelerator never waits for the slowest request of a static batch. ").split()
SIDES = ("copy", "copy_mlx", "recompute")


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def prompt_ids(eng: Engine, tag: str, length: int) -> list[int]:
    words = [tag] + [WORDS[i % len(WORDS)] for i in range(length)]
    ids = eng.encode(" ".join(words))[:length]
    if len(ids) != length:
        raise RuntimeError(f"the prompt text gave {len(ids)} tokens, not {length}")
    return ids


def repeated(eng: Engine, ids: list[int],
             copies: list[float] | None) -> tuple[float, int, float | None]:
    """The second of two identical requests: (seconds, cached prompt tokens, ms of its copy
    or None). copies: the engine's timed_copies list (None: an engine that does not copy)."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate(ids, params)
    calls = len(copies) if copies is not None else 0
    t0 = time.perf_counter()
    result = eng.generate(ids, params)
    seconds = time.perf_counter() - t0
    copied = sum(copies[calls:]) if copies is not None and len(copies) > calls else None
    return seconds, result.cached_prompt_tokens, copied


def timed_copies(eng: Engine) -> list[float]:
    """The engine's pool copies timed: a list the ms of each copy_rows call are appended to
    (on the engine thread, as it makes them)."""
    times: list[float] = []
    copy = eng.pool.copy_rows

    def timed(copies) -> None:
        t0 = time.perf_counter()
        copy(copies)
        times.append((time.perf_counter() - t0) * 1e3)
    eng.pool.copy_rows = timed
    return times


def measure(weights: str, context: int, tails: list[int], rounds: int) -> dict:
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    engines = {}
    try:
        for side in SIDES:
            eng = Engine(EngineConfig(weights=weights)).start()
            if side == "recompute":  # before any request: nothing indexed, nothing copied
                eng.block_manager.copy_partial = False
            else:  # any number of rows, so the table shows where copying pays
                eng.block_manager.min_copy_rows = 1
            if side == "copy_mlx":
                eng.pool.copy_op = None
            engines[side] = eng
        if engines["copy"].pool.copy_op is None:
            raise RuntimeError("the native copy is not built here: run python -m "
                               "engine.native.build")
        block = engines["copy"].block_manager.block_size
        copying = SIDES[:2]
        copy_calls = {s: timed_copies(engines[s]) for s in copying}
        times: dict[str, dict[int, list[float]]] = {s: {t: [] for t in tails} for s in SIDES}
        copy_ms: dict[str, dict[int, list[float]]] = {s: {t: [] for t in tails} for s in copying}
        cached: dict[str, dict[int, int]] = {s: {} for s in SIDES}
        for r in range(rounds):
            log(f"round {r + 1} of {rounds}")
            for tail in tails:
                for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                    eng = engines[side]
                    ids = prompt_ids(eng, f"Round{r}{side}{tail}:", context + tail)
                    seconds, cached[side][tail], copied = repeated(eng, ids,
                                                                   copy_calls.get(side))
                    times[side][tail].append(seconds * 1e3)
                    if copied is not None:  # it had rows to copy
                        copy_ms[side][tail].append(copied)
        model = engines["copy"].loaded
        info = {"model": model.name, "weights": model.weights, "block_size": block,
                "backend": backend_info()["backend"]}
    finally:
        for eng in engines.values():
            eng.stop()
    rows = []
    for tail in tails:
        med = {s: statistics.median(times[s][tail]) for s in SIDES}
        rows.append({"tail": tail, "prompt_tokens": context + tail,
                     "cached": {s: cached[s][tail] for s in SIDES},
                     "ms": med, "runs_ms": {s: times[s][tail] for s in SIDES},
                     "copy_ms": {s: statistics.median(copy_ms[s][tail]) if copy_ms[s][tail]
                                 else None for s in copying},
                     "ratio": med["recompute"] / med["copy"],
                     "mlx_ratio": med["copy_mlx"] / med["copy"]})
    return {"started": started, "context": context,
            "rounds": rounds, **info, "rows": rows}


def render(data: dict) -> str:
    lines = [f"A repeated prompt's first token on {data['model']} ({data['weights']}, backend "
             f"{data['backend']}, blocks of {data['block_size']} tokens), "
             f"`benchmarks/prefix_copy.py`, run {data['started']}: prompts of "
             f"{data['context']} tokens plus the tail, each sent twice; the second request's "
             f"time with max_tokens 1, medians of {data['rounds']} rounds, the engines in "
             "turn; the copying ones copy any number of rows (the engine copies from "
             f"{ROWS_WORTH_COPYING_NATIVE} on with the native op, from {ROWS_WORTH_COPYING} "
             "with MLX's ops), before the step. Cached: the prompt tokens the second request "
             "did not compute. The copy alone: the pool's copy_rows call, timed on the engine "
             "thread (none at a tail of 1: no row to copy).", "",
             "| tail tokens | copied: cached | native copy: ms | MLX's copy: ms | computed "
             "again: cached | ms | computed again / native copy | MLX's copy / native copy | "
             "the copy alone, native: ms | the copy alone, MLX's: ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def alone(ms: float | None) -> str:
        return "-" if ms is None else f"{ms:.2f}"
    for r in data["rows"]:
        lines.append(f"| {r['tail']} | {r['cached']['copy']} | {r['ms']['copy']:.1f} | "
                     f"{r['ms']['copy_mlx']:.1f} | "
                     f"{r['cached']['recompute']} | {r['ms']['recompute']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['mlx_ratio']:.2f}x | "
                     f"{alone(r['copy_ms']['copy'])} | {alone(r['copy_ms']['copy_mlx'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--context", type=int, default=160,
                    help="prompt tokens before the tail (a multiple of the block size)")
    ap.add_argument("--tails", type=int, nargs="+", default=[2, 3, 4, 5, 8, 12, 15])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "prefix_copy"))
    args = ap.parse_args(argv)
    data = measure(args.weights, args.context, args.tails, args.rounds)
    text = render(data)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    print(f"(written to {out.with_suffix('.md')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
