"""The prefill chunk (--max-num-batched-tokens): a long prompt's TTFT against the inter-token
latency of the streams that decode while it prefills.

    .venv/bin/python benchmarks/chunk_size.py [--chunks 256 512 1024 2048] [--prompt 4096]
        [--streams 4] [--weights auto]

For each chunk size, a fresh engine (prefix caching off) serves --streams greedy requests of
short prompts; once they are decoding, a --prompt-token request arrives. Decode rows go first
in every step (engine/scheduler.py), so each step of its prefill holds the streams' decode rows
plus a chunk of the prompt: a larger chunk means fewer, longer steps, so a shorter TTFT and a
longer wait between the streams' tokens. Times are the engine's own event stamps: TTFT from the
long request's arrival to its first token, and the gaps between each stream's consecutive
tokens, split into those that overlap the long prefill and those that do not.

Writes chunk_size.md and chunk_size.json to --out-dir (benchmarks/results); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import engine_batching as eb  # benchmarks/engine_batching.py (the script directory is on sys.path)
from context_length import make_prompt  # benchmarks/context_length.py
from llama_cpp_peer import log  # benchmarks/llama_cpp_peer.py
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TokenEvent
from engine.platform import backend_info, blas_name
from engine.sampling import SamplingParams

BLOCK_SIZE = 16


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure(chunk: int, args) -> dict:
    tokens = args.prompt + 1 + args.streams * (64 + args.stream_tokens)
    eng = Engine(EngineConfig(weights=args.weights, max_num_seqs=args.streams + 1,
                              max_num_batched_tokens=chunk, block_size=BLOCK_SIZE,
                              num_kv_blocks=-(-tokens // BLOCK_SIZE) + 8,
                              enable_prefix_caching=False)).start()
    try:
        tok = eng.loaded.tokenizer
        eb.run_engine(eng, [make_prompt(tok, min(chunk, args.prompt) + 16, "warm-up")], 2)
        params = SamplingParams(max_tokens=args.stream_tokens, ignore_eos=True)
        streams = [eng.submit(make_prompt(tok, 24 + 8 * i, f"stream {i}"), params)
                   for i in range(args.streams)]
        time.sleep(args.settle)  # the streams are decoding before the long prompt arrives
        long = eng.submit(make_prompt(tok, args.prompt, "long prompt"),
                          SamplingParams(max_tokens=1)).result()
        for h in streams:
            h.cancel()
        events = [[e for e in h if isinstance(e, TokenEvent)] for h in streams]
        weights = eng.loaded.weights
    finally:
        eng.stop()
    start, end = long.arrival_time, long.first_token_time
    during, outside = [], []
    for evs in events:
        for a, b in zip(evs, evs[1:], strict=False):
            (during if a.time < end and b.time > start else outside).append(b.time - a.time)
    if not during:
        raise RuntimeError(f"chunk {chunk}: no stream token overlapped the long prefill; raise "
                           "--stream-tokens")
    return {"chunk": chunk, "weights": weights, "ttft_s": end - start,
            "itl_during_ms": {"median": 1e3 * statistics.median(during),
                              "p99": 1e3 * percentile(during, 0.99), "max": 1e3 * max(during)},
            "itl_outside_ms": 1e3 * statistics.median(outside) if outside else None,
            "stream_tokens_during": len(during)}


def render(data: dict) -> str:
    lines = ["# The prefill chunk: TTFT against the streams' inter-token latency", "",
             f"`{data['command']}`, run {data['started']}: backend {data['backend']}, BLAS "
             f"{data['blas']}, weights {data['weights']}; {data['streams']} streams decoding "
             f"while a {data['prompt']}-token prompt prefills (engine event times).", "",
             "| chunk (max_num_batched_tokens) | long prompt TTFT s | streams' ITL during "
             "its prefill, median / p99 / max ms | ITL otherwise, median ms |",
             "|---|---|---|---|"]
    for r in data["rows"]:
        d = r["itl_during_ms"]
        other = "–" if r["itl_outside_ms"] is None else f"{r['itl_outside_ms']:.0f}"
        lines.append(f"| {r['chunk']} | {r['ttft_s']:.2f} | {d['median']:.0f} / {d['p99']:.0f} "
                     f"/ {d['max']:.0f} | {other} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--prompt", type=int, default=4096, help="tokens of the long prompt")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=2000,
                    help="max_tokens of each stream (cancelled once the long prompt is in)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds the streams decode before the long prompt arrives")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if min(args.chunks) < 1 or args.prompt < 1 or args.streams < 1:
        ap.error("--chunks, --prompt and --streams must be positive")
    info = backend_info()
    data = {"command": shlex.join([".venv/bin/python", "benchmarks/chunk_size.py", *argv]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": info["backend"],
            "blas": blas_name(info.get("blas")) or "bundled", "prompt": args.prompt,
            "streams": args.streams, "rows": []}
    for chunk in args.chunks:
        log(f"chunk {chunk}...")
        row = measure(chunk, args)
        d = row["itl_during_ms"]
        log(f"chunk {chunk}: TTFT {row['ttft_s']:.2f} s, streams' ITL during the prefill median "
            f"{d['median']:.0f} ms, max {d['max']:.0f} ms")
        data["rows"].append(row)
    data["weights"] = data["rows"][0]["weights"]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_size.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / "chunk_size.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
