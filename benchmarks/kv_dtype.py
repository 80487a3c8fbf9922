"""What a narrower KV cache (--kv-dtype) does to agreement with mlx-lm.

    .venv/bin/python benchmarks/kv_dtype.py [--weights f32] [--max-tokens 64]

For each KV dtype (auto = the model's float32, float16, bfloat16), the engine's greedy ids and
logprobs on the reference prompts (engine.testing.REFERENCE_PROMPTS) plus one 1700-token prompt
(four prefill chunks), against mlx-lm's own generate_step on the folder `batchscope
export-model --weights W` writes (its cache holds the model's dtype). Per dtype: the prompts
whose ids equal mlx-lm's, the first differing token of the others, and the largest |logprob
difference| of a chosen token over the tokens before any difference. f32 by default: mlx-lm's
CPU quantized matmul takes one row at a time, minutes for the long prompt at q4.

Speed at depth: benchmarks/context_length.py --kv-dtype D. Writes kv_dtype.md and
kv_dtype.json to --out-dir (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
from llama_cpp_peer import log  # benchmarks/llama_cpp_peer.py
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TokenEvent
from engine.sampling import SamplingParams
from engine.testing import REFERENCE_PROMPTS, embedded_tokenizer, mlx_lm_greedy

DTYPES = ("auto", "float16", "bfloat16")


def mlx_lm_runs(weights: str, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    _, generate = mlx_lm_greedy(weights)
    return [generate(ids, max_tokens) for ids in prompts]


def engine_runs(weights: str, kv_dtype: str, prompts: list[list[int]], max_tokens: int):
    config = EngineConfig(weights=weights, kv_dtype=kv_dtype, num_kv_blocks=256,
                          enable_prefix_caching=False)
    with Engine(config).start() as eng:
        out = []
        for ids in prompts:
            h = eng.submit(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               logprobs=1))
            logprobs = [e.logprob for e in h if isinstance(e, TokenEvent)]
            out.append((h.result().token_ids, logprobs))
        return out, str(eng.pool.dtype)


def compare(ours: tuple, ref: tuple) -> dict:
    ids, logprobs = ours
    ref_ids, ref_lp = ref
    first = next((i for i, (a, b) in enumerate(zip(ids, ref_ids, strict=True)) if a != b), None)
    upto = len(ids) if first is None else first
    diff = max((abs(logprobs[i] - float(ref_lp[i][ids[i]])) for i in range(upto)), default=0.0)
    return {"first_difference": first, "max_logprob_diff": diff}


def render(data: dict) -> str:
    lines = ["# KV dtype against mlx-lm", "",
             f"`{data['command']}`, run {data['started']}: weights {data['weights']}, "
             f"{data['max_tokens']} greedy tokens per prompt, {len(data['prompts'])} prompts "
             f"(the last {data['prompts'][-1]} tokens long); mlx-lm's cache in the model's "
             "dtype.", "",
             "| KV dtype | pool dtype | prompts equal to mlx-lm | first differing token (per "
             "prompt) | max abs logprob difference before it |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        firsts = ", ".join("–" if c["first_difference"] is None else str(c["first_difference"])
                           for c in r["prompts"])
        equal = sum(c["first_difference"] is None for c in r["prompts"])
        worst = max(c["max_logprob_diff"] for c in r["prompts"])
        lines.append(f"| {r['kv_dtype']} | {r['pool_dtype']} | {equal} / {len(r['prompts'])} "
                     f"| {firsts} | {worst:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="f32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    tok = embedded_tokenizer()
    prompts = ([tok.encode(p) for p in REFERENCE_PROMPTS]
               + [tok.encode(" ".join(REFERENCE_PROMPTS * 40))[:1700]])
    log(f"mlx-lm on the exported {args.weights} folder...")
    ref = mlx_lm_runs(args.weights, prompts, args.max_tokens)
    rows = []
    for kv in DTYPES:
        log(f"batchscope, kv_dtype {kv}...")
        ours, pool_dtype = engine_runs(args.weights, kv, prompts, args.max_tokens)
        rows.append({"kv_dtype": kv, "pool_dtype": pool_dtype,
                     "prompts": [compare(o, r) for o, r in zip(ours, ref, strict=True)]})
    data = {"command": shlex.join([".venv/bin/python", "benchmarks/kv_dtype.py", *argv]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "weights": args.weights,
            "max_tokens": args.max_tokens, "prompts": [len(p) for p in prompts], "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_dtype.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / "kv_dtype.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
