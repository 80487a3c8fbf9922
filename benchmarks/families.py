"""Decode speed of every supported model family: the engine against mlx-lm's batch_generate on
the same tiny random-weight folder, in one run.

For each family a small folder is made with mlx-lm's own classes (engine.testing), loaded by
both systems with the same weights, and measured as benchmarks/engine_batching.py measures:
decode tokens/s from the extra time of a max_tokens=N+1 call over a max_tokens=1 call, at 1 and
8 concurrent requests, the two systems interleaved per round. The ratio is engine /
batch_generate, the median of the rounds' ratios.

    .venv/bin/python benchmarks/families.py [--families llama qwen3 ...] [--weights f32]
        [--concurrency 1 8] [--repeats 3] [--out benchmarks/results/families.json]

The default families are the test suite's tiny models (engine.testing.FAMILY_CONFIGS: hidden
64-128, 2-8 layers, the embedded tokenizer's 49152-token vocabulary), so the numbers say more
about per-step overhead and the lm_head than about a real model's weights; the embedded model's
numbers are engine_batching.py's. SIZED adds configs of a real model's size, chosen by name
(`--families qwen3_5-135m`): they are not in FAMILY_CONFIGS, whose every entry the test suite
builds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
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

# A hybrid of the embedded model's size (SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 kv
# heads of 64, MLP 1536, tied embeddings; ~143M parameters): every 4th layer gated attention
# (7), the other 23 Gated DeltaNet with 4 key heads and 8 value heads of 64.
HYBRID_135M = {
    "model_type": "qwen3_5", "hidden_size": 576, "num_hidden_layers": 30,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-6, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25}}
SIZED: dict[str, tuple[str, dict]] = {"qwen3_5-135m": ("qwen3_5", HYBRID_135M)}
CONFIGS = FAMILY_CONFIGS | SIZED


def make_folder(root: Path, name: str, weights: str) -> Path:
    """The random-weight folder of CONFIGS[name] under root, 4-bit for weights q4."""
    module_name, config = CONFIGS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    return make_family_folder(root / f"{name}-{weights}", module, config,
                              quantize=weights == "q4")


def bench_family(name: str, root: Path, weights: str, concurrency: list[int], max_tokens: int,
                 repeats: int) -> dict:
    folder = make_folder(root, name, weights)
    eng = Engine(EngineConfig(model=str(folder), weights=weights,
                              max_num_seqs=max(concurrency), num_kv_blocks=512,
                              max_num_batched_tokens=max(512, 130 * max(concurrency)),
                              enable_prefix_caching=False)).start()
    loaded = load_folder(folder, weights)  # the same weights, on this thread for mlx-lm
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
                 repeats: int, command: str) -> str:
    head = " | ".join(f"{c} req: engine | batch_generate | ratio" for c in concurrency)
    lines = [
        f"Decode tok/s on random-weight folders (engine.testing.FAMILY_CONFIGS; "
        f"{', '.join(SIZED)}: benchmarks/families.py's SIZED), "
        f"{max_tokens} new tokens per request, median of {repeats} interleaved rounds; "
        f"backend {info['backend']}, "
        f"BLAS {blas_name(info.get('blas')) or 'bundled'}. Command: "
        f"`{command}`.",
        "", f"| family | weights | {head} |",
        "|---|---|" + "---|---|---|" * len(concurrency)]
    for r in results:
        cells = " | ".join(f"{x['engine_decode_tps']:.0f} | {x['batch_generate_decode_tps']:.0f}"
                           f" | {x['ratio']:.2f}x" for x in r["rows"])
        lines.append(f"| {r['family']} | {r['weights']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--families", nargs="+", default=sorted(FAMILY_CONFIGS),
                    help=f"default: every FAMILY_CONFIGS entry; also {', '.join(SIZED)}")
    ap.add_argument("--weights", default="f32", choices=["f32", "q4"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/families.json")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.families) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(sorted(CONFIGS))}")
    info = backend_info()
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            results.append(bench_family(name, Path(tmp), args.weights, args.concurrency,
                                        args.max_tokens, args.repeats))
    command = shlex.join([".venv/bin/python", "benchmarks/families.py", *argv])
    table = render_table(results, args.concurrency, info, args.max_tokens, args.repeats, command)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command,
                               "backend": info | {"blas": blas_name(info.get("blas"))},
                               "results": results}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')} in {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
