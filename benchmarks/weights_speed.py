"""Decode and prefill speed of the embedded model per weights format, with and without OpenBLAS.

Usage: python benchmarks/weights_speed.py [--tokens 32] [--repeats 3] [--batches 1,4]
                                          [--prefill 64]

The optimized BLAS has to be loaded before mlx is imported, so every measurement runs in a
child process (this script, re-run with --child FORMAT; BATCHSCOPE_NO_BLAS=1 for the
reference BLAS). One process per format, too, so that no format inherits another's
allocations or thread state. The formats run back to back, so the ratios against q4 come
from one stretch of machine time. OpenBLAS's threads make f32 sensitive to any other load
on the machine: the load average is printed with the table.

Decode: greedy, mlx-lm's own llama forward with its KVCache; one prefill, a few warm-up
steps, then the median of --repeats timed runs of --tokens steps (the cache is trimmed back
to the prompt between runs). Batch 1 is the headline; batch 4 (the same
prompt in every row, one forward call for all rows) shows which format gains from
batching. Speeds are aggregate tokens/s. Prefill: one forward call over a --prefill-token
prompt, best of two. docs/weights.md holds the table of a past run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FORMATS = ("q4", "f32", "bf16")
WARM_UP_STEPS = 4
PROMPT = (
    "<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PREFILL_TEXT = (
    "Continuous batching lets an inference server add and remove requests at every step. "
    "Each step runs one forward pass over the rows of every running sequence. "
) * 8


def _decode_runs(model, prompt_ids: list[int], n_tokens: int, batch: int, runs: int) -> list:
    """Prefill `batch` copies of the prompt once, warm up with a few steps, then time `runs`
    greedy decodes of n_tokens steps each, trimming the KV cache back to the prompt between
    runs."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    first = mx.argmax(model(mx.array([prompt_ids] * batch), cache=cache)[:, -1, :], axis=-1)
    mx.eval(first)

    def decode(steps: int) -> float:
        token = first
        start = time.perf_counter()
        for _ in range(steps):
            token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.eval(token)
        elapsed = time.perf_counter() - start
        trim_prompt_cache(cache, steps)
        return batch * steps / elapsed

    decode(WARM_UP_STEPS)
    return [decode(n_tokens) for _ in range(runs)]


def _prefill_tokens_per_s(model, ids: list[int]) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    best = float("inf")
    for _ in range(2):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        mx.eval(model(mx.array([ids]), cache=cache))
        best = min(best, time.perf_counter() - start)
    return len(ids) / best


def run_child(fmt: str, n_tokens: int, repeats: int, batches: list[int], prefill: int) -> dict:
    from engine.platform import backend_info, preload_blas

    preload_blas()  # before the first mlx import (engine/__init__ does it too)
    from engine.model_loader import load_embedded

    loaded = load_embedded(fmt)
    ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
    decode = {
        str(batch): statistics.median(_decode_runs(loaded.model, ids, n_tokens, batch, repeats))
        for batch in batches
    }
    result = {"backend": backend_info(), "decode": decode}
    if prefill:
        long_ids = loaded.tokenizer.encode(PREFILL_TEXT, add_special_tokens=False)[:prefill]
        result["prefill"] = _prefill_tokens_per_s(loaded.model, long_ids)
    return result


def _spawn(fmt: str, no_blas: bool, argv: list[str]) -> dict:
    env = dict(os.environ)
    env.pop("BATCHSCOPE_NO_BLAS", None)
    if no_blas:
        env["BATCHSCOPE_NO_BLAS"] = "1"
    cmd = [sys.executable, __file__, "--child", fmt, *argv]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _measure(no_blas: bool, argv: list[str], batches: list[int]) -> tuple[dict, dict]:
    """Run every format in its own process; return (backend info, {measure: {fmt: tok/s}})."""
    table: dict[str, dict[str, float]] = {}
    info: dict = {}
    for fmt in FORMATS:
        result = _spawn(fmt, no_blas, argv)
        info = result["backend"]
        for batch in batches:
            table.setdefault(f"decode, batch {batch}", {})[fmt] = result["decode"][str(batch)]
        if "prefill" in result:
            table.setdefault("prefill", {})[fmt] = result["prefill"]
    return info, table


def _row(label: str, what: str, speeds: dict) -> str:
    q4 = speeds["q4"]
    return (
        f"| {label} | {what} | {q4:.1f} | {speeds['f32']:.1f} | {speeds['bf16']:.1f} "
        f"| {speeds['f32'] / q4:.2f}x | {speeds['bf16'] / q4:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs per format")
    parser.add_argument("--batches", default="1,4", help="comma-separated decode batch sizes")
    parser.add_argument("--prefill", type=int, default=64, help="prefill prompt tokens (0: skip)")
    parser.add_argument("--child", choices=FORMATS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(
            f"--batches must be comma-separated integers, got {args.batches!r}"
        ) from None
    if args.tokens < 1 or args.repeats < 1 or min(batches) < 1 or args.prefill < 0:
        raise ValueError("--tokens, --repeats and batch sizes must be >= 1, --prefill >= 0")

    if args.child:
        result = run_child(args.child, args.tokens, args.repeats, batches, args.prefill)
        print(json.dumps(result))
        return

    argv = ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
    argv += ["--batches", args.batches, "--prefill", str(args.prefill)]
    load_before = os.getloadavg()[0]
    blas_info, blas_table = _measure(False, argv, batches)
    _, ref_table = _measure(True, argv, batches)
    load_after = os.getloadavg()[0]

    print(
        f"backend {blas_info['backend']}, mlx {blas_info['mlx_version']}, "
        f"{blas_info['machine']}, {os.cpu_count()} CPUs; decode: {args.tokens} tokens, "
        f"median of {args.repeats}; prefill: {args.prefill} tokens"
    )
    print(f"OpenBLAS: {blas_info['blas']}")
    print(f"load average (1 min) before/after: {load_before:.2f} / {load_after:.2f}")
    print()
    print("| BLAS | measure | q4 tok/s | f32 tok/s | bf16 tok/s | f32 / q4 | bf16 / q4 |")
    print("|---|---|---|---|---|---|---|")
    blas_label = "OpenBLAS" if blas_info["blas"] else "OpenBLAS not found (reference)"
    for label, table in ((blas_label, blas_table), ("reference BLAS", ref_table)):
        for what, speeds in table.items():
            print(_row(label, what, speeds))


if __name__ == "__main__":
    main()
