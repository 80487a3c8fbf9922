"""Time to first token and decode speed against prompt length: batchscope and llama.cpp.

    .venv/bin/python benchmarks/context_length.py [--lengths 512 1024 2048 4096 8192]
        [--decode-tokens 64] [--weights auto] [--repeats 3] [--threads N]
        [--kv-dtype auto float16]

For each prompt length N:

batchscope  the engine in process (prefix caching off, a KV pool that holds N + D + 1 tokens):
            one request of exactly N token ids (real text, each length opening with its own
            sentence) and max_tokens 1 + D, greedy, ignore-eos, timed by the engine's own
            events: TTFT from its arrival to its first token, decode tok/s at depth N as D
            over the time from the first token to the last; prefill tok/s = N / TTFT. Median
            of --repeats rounds. The embedded model has 8192 positions: a length that leaves no
            room for 1 + D tokens is cut to context - D - 1 (the table gives the real count).
            One engine per --kv-dtype (default: auto, the model's dtype as mlx-lm's cache,
            and float16, the KV type llama-bench runs with), each measured at every length.
llama.cpp   when built (./scripts/build-llama-cpp.sh), on the GGUF the embedded model loads:
            `llama-bench -p N -n 0` (prompt processing tok/s; its TTFT is N / that rate) and
            `llama-bench -p 0 -n D -d N` (generation tok/s after N tokens in the cache), -r
            --llama-repetitions each, with flash attention off and on (-fa 0,1): the faster
            setting counts (which one wins differs between the two tests; the table says).
            Without a build it says so and measures batchscope only.

Per length llama.cpp runs first, then batchscope's engines, so drift over the run shows. Writes
context_length.md, .json and .svg to --out-dir (benchmarks/results); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import engine_batching as eb  # benchmarks/engine_batching.py (the script directory is on sys.path)
from llama_cpp_peer import (  # benchmarks/llama_cpp_peer.py
    embedded_gguf_path, llama_cpp_bin, llama_cpp_python_version, log)
# isort: on

from mlx.utils import tree_flatten

from app.charts import INK, PALETTE, Panel, Point, Series, Svg, extent
from engine import native
from engine.config import KV_DTYPES, EngineConfig
from engine.engine import Engine
from engine.platform import backend_info, blas_name
from engine.sampling import SamplingParams

LENGTHS = (512, 1024, 2048, 4096, 8192)
DECODE_TOKENS = 64
BLOCK_SIZE = 16
# Goals: at GOAL_LENGTH tokens a TTFT no longer than llama.cpp's and decode at least as fast as
# its tg; the prefill rate at PREFILL_LONG keeps at least PREFILL_KEEP of the rate at
# PREFILL_SHORT.
GOAL_LENGTH = 4096
PREFILL_SHORT, PREFILL_LONG, PREFILL_KEEP = 512, 4096, 0.7


# ---- llama.cpp --------------------------------------------------------------------------------


def parse_llama_bench(text: str, n_prompt: int, n_gen: int, n_depth: int) -> dict:
    """The tests of `llama-bench -o json` output (one per flash-attention setting): the best
    one's mean tok/s (avg_ts), its samples and its setting, and every setting's mean."""
    try:
        tests = json.loads(text)
        runs = []
        for test in tests:
            shape = (test["n_prompt"], test["n_gen"], test["n_depth"])
            if shape != (n_prompt, n_gen, n_depth):
                raise RuntimeError(
                    f"llama-bench ran p/n/d {shape}, not {(n_prompt, n_gen, n_depth)}")
            runs.append({"tps": float(test["avg_ts"]),
                         "samples_tps": [float(s) for s in test.get("samples_ts", [])],
                         "flash_attn": int(test.get("flash_attn", -1))})
        best = max(runs, key=lambda r: r["tps"])
    except (ValueError, TypeError, KeyError) as e:
        raise RuntimeError(f"could not read llama-bench's JSON ({e!r}):\n{text[-2000:]}") from e
    return best | {"tps_by_flash_attn": {r["flash_attn"]: r["tps"] for r in runs}}


def llama_bench(bin_dir: Path, gguf: Path, threads: int, reps: int, n_prompt: int, n_gen: int,
                n_depth: int = 0) -> dict:
    """llama.cpp at its best: the test with flash attention off and on, the faster of the two
    (docs/benchmarks.md gives which won where)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_gen),
           "-d", str(n_depth), "-t", str(threads), "-r", str(reps), "-fa", "0,1", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return parse_llama_bench(done.stdout, n_prompt, n_gen, n_depth)


# ---- batchscope -------------------------------------------------------------------------------


def make_prompt(tokenizer, n: int, tag: str) -> list[int]:
    """Exactly n token ids of real text, opening with a sentence of its own (`tag`)."""
    head = tokenizer.encode(f"Context length test {tag}: read this and answer. ")
    # The ids of a passage, repeated: encoding the whole prompt at once would run past the
    # tokenizer's model length (a warning), and tokens per copy vary with what precedes them.
    body = tokenizer.encode(eb.TEXT * 8)
    return (head + body * (n // len(body) + 1))[:n]


def engine_config(args, lengths: list[int], kv_dtype: str) -> EngineConfig:
    """One sequence at a time, prefix caching off (the max_tokens=1+D request must prefill
    again, and no length may reuse another's blocks), a pool for the longest request."""
    tokens = max(lengths) + args.decode_tokens + 1
    return EngineConfig(weights=args.weights, max_num_seqs=1,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        block_size=BLOCK_SIZE, num_kv_blocks=-(-tokens // BLOCK_SIZE) + 1,
                        enable_prefix_caching=False, kv_dtype=kv_dtype)


def pool_dtype_name(eng: Engine) -> str:
    """The pool's dtype as the table shows it: "float16", or "auto (float32)"."""
    name = str(eng.pool.dtype).removeprefix("mlx.core.")
    return name if eng.config.kv_dtype == name else f"{eng.config.kv_dtype} ({name})"


def kv_bytes(eng: Engine, depth: int) -> int:
    """Bytes of keys and values one decode row reads at this depth: every pool layer's
    positions (a sliding-window layer's last `window` only)."""
    pool = eng.pool
    windows = {kv.pool_layer: kv.window for kv in eng.runner.layer_kv if kv.writes}
    return sum(2 * pool.kv_heads[i] * pool.head_dims[i] * pool.dtype.size
               * min(depth, windows.get(i) or depth) for i in range(pool.num_layers))


def engine_at(eng: Engine, ids: list[int], decode_tokens: int, repeats: int) -> dict:
    """One request of 1 + D tokens per round, timed by the engine's own events: TTFT from
    arrival to the first token, decode tok/s from the first token to the last."""
    ttft, decode = [], []
    for _ in range(repeats):
        r = eng.submit(ids, SamplingParams(max_tokens=1 + decode_tokens,
                                           ignore_eos=True)).result()
        assert r.completion_tokens == 1 + decode_tokens, r
        ttft.append(r.first_token_time - r.arrival_time)
        decode.append(decode_tokens / (r.finish_time - r.first_token_time))
    t, d = statistics.median(ttft), statistics.median(decode)
    return {"ttft_s": t, "ttft_runs": ttft, "prefill_tps": len(ids) / t, "decode_tps": d,
            "decode_runs": decode, "ms_per_token": 1000 / d}


# ---- output -----------------------------------------------------------------------------------


def _f(v, fmt: str, suffix: str = "") -> str:
    return "–" if v is None else f"{v:{fmt}}{suffix}"


def _fa(setting: int | None) -> str:
    return "" if setting is None else f" (fa {setting})"


def goals(data: dict) -> list[dict]:
    """The goal lines for the lengths measured (by prompt tokens), per KV dtype measured."""
    out = []
    for kv in dict.fromkeys(r["kv"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["kv"] == kv]
        out += [g | {"goal": f"{g['goal']} (KV {kv})"} for g in goals_of(rows)]
    return out


def goals_of(rows: list[dict]) -> list[dict]:
    by_n = {r["prompt_tokens"]: r for r in rows}
    out = []
    r = by_n.get(GOAL_LENGTH)
    if r is not None and r.get("llama_ttft_s") is not None:
        out.append({"goal": f"TTFT at {GOAL_LENGTH // 1024}k <= llama.cpp's",
                    "met": r["ttft_s"] <= r["llama_ttft_s"],
                    "detail": f"batchscope {r['ttft_s']:.2f} s, llama.cpp {r['llama_ttft_s']:.2f} "
                              f"s ({r['ttft_ratio']:.2f}x)"})
    if r is not None and r.get("llama_tg_tps") is not None:
        out.append({"goal": f"decode at depth {GOAL_LENGTH // 1024}k >= llama.cpp's tg",
                    "met": r["decode_tps"] >= r["llama_tg_tps"],
                    "detail": f"batchscope {r['decode_tps']:.1f} tok/s, llama.cpp "
                              f"{r['llama_tg_tps']:.1f} ({r['decode_ratio']:.2f}x)"})
    short, long = by_n.get(PREFILL_SHORT), by_n.get(PREFILL_LONG)
    if short is not None and long is not None:
        keep = long["prefill_tps"] / short["prefill_tps"]
        out.append({"goal": f"prefill rate at {PREFILL_LONG} within "
                            f"{1 - PREFILL_KEEP:.0%} of the rate at {PREFILL_SHORT}",
                    "met": keep >= PREFILL_KEEP,
                    "detail": f"{long['prefill_tps']:.0f} vs {short['prefill_tps']:.0f} tok/s "
                              f"({keep:.0%} of it; goal >= {PREFILL_KEEP:.0%})"})
    return out


def render(data: dict) -> str:
    m = data["machine"]
    peer = (f"llama.cpp (llama-cpp-python {data['llama_cpp_python']} sdist) with "
            f"{data['threads']} threads, `llama-bench -r {data['llama_repetitions']}`"
            if data["llama_cpp"] else "llama.cpp not built (./scripts/build-llama-cpp.sh): "
            "batchscope only")
    paths = "".join(f", {k.replace('_', ' ')} {v}"
                    for k, v in (data.get("engine_paths") or {}).items())
    lines = [
        "# Context length: batchscope and llama.cpp", "",
        f"`{data['command']}`, run {data['started']}: backend {m['backend']}, BLAS {m['blas']}, "
        f"native quantized path {m['quantized_isa']}, {m['cpus']} CPUs; batchscope weights "
        f"{data['weights']} (asked: {data['weights_asked']}), prefill chunks of "
        f"{data['max_num_batched_tokens']} tokens{paths}; {peer} on {data['gguf']}.", "",
        f"batchscope: one greedy request of max_tokens={data['decode_tokens'] + 1} "
        "(ignore-eos) per round, timed by the engine's events: TTFT from arrival to the first "
        "token, decode tok/s from the first token to the last; median of "
        f"{data['repeats']}. Bytes per decoded token: the weights a step reads plus the "
        "context's keys and values at that depth; GB/s is that times the decode rate. "
        "llama.cpp: `llama-bench -p N -n 0` (TTFT = N / its tok/s) and `llama-bench -p 0 -n "
        f"{data['decode_tokens']} -d N`, each with `-fa 0,1` (flash attention off and on), "
        "the faster setting's mean (the setting in brackets). Ratios above 1 favour "
        "batchscope.", "",
        "| prompt tokens | KV dtype | batchscope TTFT s | prefill tok/s | llama.cpp pp tok/s "
        "| TTFT ratio (llama.cpp time / ours) | decode tok/s at depth | llama.cpp tg at depth "
        "| decode ratio (ours / llama.cpp) | MB read per token (weights + KV) | GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        mb = r["bytes_per_token"] / 1e6 if r.get("bytes_per_token") else None
        n = str(r["prompt_tokens"])
        if r["prompt_tokens"] != r["requested"]:
            n += f" (asked {r['requested']})"
        lines.append(
            f"| {n} | {r['kv']} | {r['ttft_s']:.3f} | {r['prefill_tps']:.0f} | "
            f"{_f(r.get('llama_pp_tps'), '.0f')}{_fa(r.get('llama_pp_fa'))} | "
            f"{_f(r.get('ttft_ratio'), '.2f', 'x')} | "
            f"{r['decode_tps']:.1f} | "
            f"{_f(r.get('llama_tg_tps'), '.1f')}{_fa(r.get('llama_tg_fa'))} | "
            f"{_f(r.get('decode_ratio'), '.2f', 'x')} | {_f(mb, '.0f')} | "
            f"{_f(mb and mb * r['decode_tps'] / 1e3, '.1f')} |")
    g = data.get("goals") or []
    if g:
        lines.append("")
        lines += [f"- {x['goal']}: {'met' if x['met'] else 'not met'} ({x['detail']})" for x in g]
    lines.append("")
    return "\n".join(lines)


def panels_svg(title: str, x_label: str,
               panels: list[tuple[str, str, list[Series]]], css: str) -> str:
    """Panels stacked one above the other, sharing the x axis; each its own y axis and legend.
    (app/charts.py's line_chart draws one panel: two units here, TTFT s and ms per token.)"""
    width, height, left, top, right, bottom = 700, 300, 64, 36, 430, 250
    xs = [p.x for _, _, ss in panels for s in ss for p in s.points]
    x_ticks, x_max = extent(xs, 1.08)
    svg = Svg(width, height * len(panels), css_class=css, title=title, fluid=True)
    for i, (heading, y_label, series) in enumerate(panels):
        dy = i * height
        y_ticks, y_max = extent(p.y for s in series for p in s.points)
        panel = Panel.linear(left, top + dy, right, bottom + dy, (0, x_max), (0, y_max))
        svg.heading(heading, x=left, y=20 + dy)
        svg.grid_y(panel, y_ticks)
        svg.ticks_x(panel, x_ticks)
        svg.frame(panel)
        mid_x, mid_y = panel.center
        svg.add("text", x_label, x=mid_x, y=dy + height - 12, text_anchor="middle", fill=INK)
        svg.add("text", y_label, x=14, y=mid_y, text_anchor="middle", fill=INK,
                transform=f"rotate(-90 14 {mid_y:.1f})")
        for s in series:
            svg.series(panel, s)
        svg.legend(right + 14, top + 8 + dy, [(s.name, s.color) for s in series])
    return svg.render()


def plot(data: dict) -> str:
    rows = data["rows"]

    def series(name: str, color: str, pts: list[tuple[int, float | None]], unit: str) -> Series:
        # Tooltips, no labels: the lengths double, so the first points sit close together.
        return Series(name, [Point(x, y, tip=f"{x} tokens: {y:.3g} {unit}")
                             for x, y in pts if y is not None], color=color, marker=3.5)

    kvs = list(dict.fromkeys(r["kv"] for r in rows))
    ttft, tpot = [], []
    for i, kv in enumerate(kvs):
        mine = [r for r in rows if r["kv"] == kv]
        name = f"batchscope, KV {kv}"
        ttft.append(series(name, PALETTE[2 * i],
                           [(r["prompt_tokens"], r["ttft_s"]) for r in mine], "s"))
        tpot.append(series(name, PALETTE[2 * i],
                           [(r["prompt_tokens"], r["ms_per_token"]) for r in mine], "ms"))
    if data["llama_cpp"]:
        once = [r for r in rows if r["kv"] == kvs[0]]  # the same llama.cpp run on every KV row
        ttft.append(series("llama.cpp", PALETTE[1],
                           [(r["prompt_tokens"], r.get("llama_ttft_s")) for r in once], "s"))
        tpot.append(series("llama.cpp", PALETTE[1],
                           [(r["prompt_tokens"], r.get("llama_ms_per_token")) for r in once],
                           "ms"))
    return panels_svg(
        f"Time against context length ({data['gguf']}, batchscope weights {data['weights']})",
        "prompt tokens (decode: tokens already in the cache)",
        [("Time to first token", "TTFT (s)", ttft),
         (f"Decode at depth ({data['decode_tokens']} tokens)", "ms per decoded token", tpot)],
        "context-length")


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS),
                    help="prompt lengths in tokens")
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS,
                    help="D: tokens decoded after the first for the decode rate")
    ap.add_argument("--weights", default="auto", help="the engine's weights (auto, q4, f32, bf16)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="engine rounds per length (their median damps machine noise)")
    ap.add_argument("--kv-dtype", nargs="+", default=["auto", "float16"], choices=KV_DTYPES,
                    help="the KV pool's dtypes (EngineConfig.kv_dtype), an engine each")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    default=EngineConfig.max_num_batched_tokens,
                    help="the engine's prefill chunk (default: EngineConfig's)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama.cpp threads (default: all CPUs, as the engine uses)")
    ap.add_argument("--llama-repetitions", type=int, default=2, help="llama-bench -r")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if min(args.lengths) < 1 or args.decode_tokens < 1 or args.repeats < 1:
        ap.error("--lengths, --decode-tokens and --repeats must be positive")

    bin_dir = llama_cpp_bin()
    gguf = embedded_gguf_path()
    if bin_dir is None:
        print("llama.cpp is not built (./scripts/build-llama-cpp.sh builds it, a long C++ "
              "build): measuring batchscope only", file=sys.stderr)
    info = backend_info()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    D = args.decode_tokens

    engines = {}
    rows = []
    try:
        for kv_dtype in dict.fromkeys(args.kv_dtype):
            engines[kv_dtype] = Engine(engine_config(args, args.lengths, kv_dtype)).start()
        eng = next(iter(engines.values()))
        tokenizer = eng.loaded.tokenizer
        cap = eng.max_model_len - D - 1
        kvs = ", ".join(map(pool_dtype_name, engines.values()))
        log(f"batchscope: weights {eng.loaded.weights}, context {eng.max_model_len}, "
            f"prompts capped at {cap} tokens, KV {kvs}; warm-up...")
        # One prompt of more than a prefill chunk (where the lengths go that far), in the pool.
        warm_n = min(cap, max(args.lengths), args.max_num_batched_tokens + 64)
        warm = make_prompt(tokenizer, warm_n, "warm-up")
        for e in engines.values():
            eb.run_engine(e, [warm], 4)
        weight_bytes = sum(a.nbytes for _, a in tree_flatten(eng.loaded.model.parameters()))
        seen = set()
        for requested in args.lengths:
            n = min(requested, cap)
            if n in seen:
                log(f"{requested} tokens: cut to {n}, already measured; skipped")
                continue
            seen.add(n)
            peer = {}
            if bin_dir is not None:
                log(f"{n} tokens: llama-bench -p {n} -n 0...")
                pp = llama_bench(bin_dir, gguf, args.threads, args.llama_repetitions, n, 0)
                log(f"{n} tokens: llama-bench -p 0 -n {D} -d {n}...")
                tg = llama_bench(bin_dir, gguf, args.threads, args.llama_repetitions, 0, D, n)
                peer = {"llama_pp_tps": pp["tps"], "llama_pp_runs": pp["samples_tps"],
                        "llama_pp_fa": pp["flash_attn"],
                        "llama_pp_by_fa": pp["tps_by_flash_attn"],
                        "llama_ttft_s": n / pp["tps"], "llama_tg_tps": tg["tps"],
                        "llama_tg_runs": tg["samples_tps"], "llama_tg_fa": tg["flash_attn"],
                        "llama_tg_by_fa": tg["tps_by_flash_attn"],
                        "llama_ms_per_token": 1000 / tg["tps"]}
                log(f"{n} tokens: llama.cpp pp {pp['tps']:.0f} tok/s (-fa {pp['flash_attn']}; "
                    f"TTFT {peer['llama_ttft_s']:.3f} s), tg at depth {tg['tps']:.1f} tok/s "
                    f"(-fa {tg['flash_attn']})")
            ids = make_prompt(tokenizer, n, f"{n} tokens, asked for {requested}")
            for e in engines.values():
                kv = pool_dtype_name(e)
                log(f"{n} tokens: batchscope, KV {kv}...")
                row = {"requested": requested, "prompt_tokens": n, "kv": kv} | peer
                row |= engine_at(e, ids, D, args.repeats)
                row["bytes_per_token"] = weight_bytes + kv_bytes(e, n + D // 2)
                if bin_dir is not None:
                    row["ttft_ratio"] = row["llama_ttft_s"] / row["ttft_s"]
                    row["decode_ratio"] = row["decode_tps"] / row["llama_tg_tps"]
                log(f"{n} tokens: batchscope, KV {kv}: TTFT {row['ttft_s']:.3f} s "
                    f"({row['prefill_tps']:.0f} tok/s), decode at depth "
                    f"{row['decode_tps']:.1f} tok/s")
                rows.append(row)
        weights = eng.loaded.weights
        paths = {"attention": eng.attention, "row_kernels": eng.row_kernels}
    finally:
        for e in engines.values():
            e.stop()

    data = {"command": shlex.join([".venv/bin/python", "benchmarks/context_length.py", *argv]),
            "started": started, "gguf": gguf.name, "weights": weights,
            "weights_asked": args.weights,
            "decode_tokens": D, "repeats": args.repeats,
            "max_num_batched_tokens": args.max_num_batched_tokens, "engine_paths": paths,
            "llama_cpp": bin_dir is not None, "threads": args.threads,
            "llama_repetitions": args.llama_repetitions,
            "llama_cpp_python": llama_cpp_python_version(bin_dir) if bin_dir else None,
            "machine": {"backend": info["backend"],
                        "blas": blas_name(info.get("blas")) or "bundled",
                        "quantized_isa": native.decode_quantized_isa(), "cpus": os.cpu_count()},
            "rows": rows}
    data["goals"] = goals(data)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_length.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / "context_length.md").write_text(text)
    (out / "context_length.svg").write_text(plot(data))
    print(text)
    log(f"written to {out}/context_length.md, .json and .svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
