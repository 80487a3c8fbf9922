"""Speculative decoding inside the batch: output tokens/s with and without prompt lookup or a
draft model, by the number of concurrent streams, on a copy-heavy workload or open questions.

    .venv/bin/python benchmarks/speculative.py [--streams 1 4 16] [--rounds 3] [--k 4]
        [--max-tokens 160] [--weights auto] [--workload copy|open]
        [--method ngram|draft] [--draft-model SPEC ...]

The copy workload asks the model (chat template, greedy, stops at EOS) to repeat a passage or
to return a piece of code with a small edit: what prompt lookup is for (rewriting a document,
editing code). 16 distinct prompts: 8 prose passages written for this benchmark and 8
functions of Python's own standard library (inspect.getsource, stable for a Python version).
The open workload is the opposite case: 16 open questions and story starts whose answers
repeat little of their prompt, where drafts are fewer and mostly wrong (results in
speculative_open.md).

The engines are loaded side by side and take turns wave by wave, so machine noise hits them
alike. --method ngram (the default): no speculation; --speculative ngram with the turn-down
lifted (speculative_max_batch = 16: it always speculates); and ngram with the default
turn-down. --method draft: no speculation, and one engine per --draft-model (layers:N, the
target's first N layers; embedded, the shipped 4-bit model, a draft for --weights f32; or a
folder), each always speculating (with the default turn-down it would not draft at 16 streams,
and at 1 and 4 it is the same engine). For S streams a wave submits S prompts at once; the rate
is output tokens over wall time, summed over the rounds. Greedy output is batch-invariant on
the CPU (native kernels), so all engines must produce the same tokens: the script checks it.
Acceptance = accepted / drafted tokens, from the step records; a draft model's share is the
time its forwards took (StepRecord.propose_time) over the wall time.

Writes speculative[_open][_draft][_WEIGHTS].md and .json to --out-dir (benchmarks/results):
_draft for --method draft, _WEIGHTS when --weights is not auto.
"""

from __future__ import annotations

import argparse
import inspect
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
from engine.engine import Engine, Submission
from engine.platform import backend_info, blas_name
from engine.sampling import SamplingParams

PASSAGES = [
    "A lighthouse keeper on a small northern island kept a logbook for forty years. Every "
    "evening he wrote down the wind, the colour of the sea and the ships that passed. When the "
    "light was automated, the logbook went to the town library, where children still read it "
    "to learn how the weather of the coast changes with the seasons.",
    "To make bread, mix flour, water, salt and a little yeast into a rough dough. Leave it "
    "covered for an hour, then fold it a few times and leave it again. Shape it into a round "
    "loaf, let it rise until it is soft and puffy, and bake it in a very hot oven until the "
    "crust is dark and sounds hollow when you knock on it.",
    "The meeting is moved to Thursday at ten in the morning, in the large room on the second "
    "floor. Please bring the quarterly numbers and a short list of the problems your team ran "
    "into. We will finish by noon, and lunch will be served in the kitchen afterwards for "
    "everyone who attended.",
    "Rivers carry sand and mud from the mountains to the sea. Where a river slows down, near "
    "its mouth, the water can no longer hold the sand, and it settles on the bottom. Over many "
    "years these deposits build up into a delta, a flat and fertile plain that farmers have "
    "used since the earliest times.",
    "Our library opens at nine on weekdays and at ten on Saturdays. Books can be borrowed for "
    "three weeks and renewed twice, online or at the front desk. Late returns cost ten cents a "
    "day. The reading room on the top floor is quiet, and laptops may be used only at the "
    "tables near the windows.",
    "The old train station was rebuilt as a market. Farmers sell vegetables on the platforms, "
    "the ticket hall is now a bakery, and the waiting room has become a small cafe. On Sunday "
    "mornings a band plays under the clock, and people from the whole valley come to shop, eat "
    "and listen.",
    "Before you start the machine, check that the water tank is full and the filter is clean. "
    "Turn the handle to the left to heat the water, wait for the green light, then press the "
    "button once for a small cup and twice for a large one. Empty the tray at the end of every "
    "day.",
    "The museum's new exhibition shows maps drawn over five centuries. The oldest are painted "
    "on leather and show sea monsters in the empty parts of the ocean. Later maps are printed "
    "on paper and become more exact, until the last room, where satellite images cover a whole "
    "wall.",
]


def _code_passages() -> list[str]:
    import json as json_module
    import shlex as shlex_module
    import textwrap

    functions = [textwrap.dedent, textwrap.indent, shlex_module.quote, shlex_module.join,
                 json_module.dumps, inspect.cleandoc, inspect.getcomments, textwrap.shorten]
    return [inspect.getsource(f) for f in functions]


OPEN_PROMPTS = [
    "Tell me a short story about a robot who learns to paint.",
    "Explain in simple terms why the sky is blue.",
    "What are three good habits for a healthy morning?",
    "Write a short poem about autumn leaves.",
    "Give me five surprising facts about snow.",
    "How does a bicycle stay upright?",
    "Describe the taste of a lemon to someone who has never had one.",
    "What should I pack for a weekend camping trip?",
    "Why do cats purr?",
    "Suggest a name for a small bakery and explain why.",
    "What is the difference between weather and climate?",
    "Write a letter to a friend about your summer holiday.",
    "How do bees make honey?",
    "Give three tips for learning a new language.",
    "What would happen if the moon disappeared?",
    "Describe a busy market on a Saturday morning.",
]


def prompts(tokenizer, workload: str = "copy") -> list[list[int]]:
    if workload == "open":
        texts = list(OPEN_PROMPTS)
    else:
        texts = [f"Repeat the following text exactly, with no comment before or after it.\n\n"
                 f"{p}" for p in PASSAGES]
        texts += ["Return this Python function unchanged, except for one more comment line at "
                  f"its top saying what it does.\n\n```python\n{code}```"
                  for code in _code_passages()]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True)) for t in texts]


CONDITIONS = {  # name -> EngineConfig overrides (--method ngram)
    "off": {},
    "ngram, always": {"speculative": "ngram", "speculative_max_batch": 16},
    "ngram, default turn-down": {"speculative": "ngram"},
}


def conditions(method: str, draft_models: list[str]) -> dict[str, dict]:
    if method == "ngram":
        return CONDITIONS
    return {"off": {}, **{f"draft {m}": {"speculative": "draft", "draft_model": m,
                                         "speculative_max_batch": 16} for m in draft_models}}


def wave(eng: Engine, ids: list[list[int]], max_tokens: int) -> dict:
    first_step = eng.step_count + 1
    params = SamplingParams(max_tokens=max_tokens)
    t0 = time.perf_counter()
    results = [h.result() for h in eng.submit_many([Submission(p, params) for p in ids])]
    wall = time.perf_counter() - t0
    steps = [r for r in eng.steps.recent() if r.step >= first_step]
    return {"wall": wall, "tokens": [r.token_ids for r in results],
            "drafted": sum(r.draft_tokens for r in steps),
            "accepted": sum(r.accepted_tokens for r in steps),
            "propose_time": sum(r.propose_time for r in steps),
            "verify_steps": sum(1 for r in steps if r.verify_rows), "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--workload", choices=("copy", "open"), default="copy")
    ap.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    ap.add_argument("--draft-model", nargs="+", default=["layers:8"], metavar="SPEC",
                    help="--method draft: the draft models, one engine each (default layers:8)")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if min(args.streams) < 1 or max(args.streams) > 16 or args.rounds < 1:
        ap.error("--streams must be 1 to 16 and --rounds positive")
    engines = {}
    for name, overrides in conditions(args.method, args.draft_model).items():
        log(f"loading engine: {name}")
        config = EngineConfig(weights=args.weights, num_speculative_tokens=args.k,
                              max_num_seqs=16, **overrides)
        engines[name] = Engine(config).start()
    try:
        eng0 = engines["off"]
        ids = prompts(eng0.tokenizer, args.workload)
        default_max_batch = EngineConfig().speculative_max_batch
        log("warm-up")
        for eng in engines.values():
            wave(eng, ids[:2], 8)
        rows = []
        for streams in args.streams:
            totals = {name: {"wall": 0.0, "tokens": 0, "drafted": 0, "accepted": 0,
                             "propose_time": 0.0} for name in engines}
            same = True
            for r in range(args.rounds):
                batch = [ids[(r * streams + i) % len(ids)] for i in range(streams)]
                outputs = {}
                for name, eng in engines.items():
                    w = wave(eng, batch, args.max_tokens)
                    t = totals[name]
                    t["wall"] += w["wall"]
                    t["tokens"] += sum(map(len, w["tokens"]))
                    t["drafted"] += w["drafted"]
                    t["accepted"] += w["accepted"]
                    t["propose_time"] += w["propose_time"]
                    outputs[name] = w["tokens"]
                same &= len({json.dumps(o) for o in outputs.values()}) == 1
                log(f"{streams} streams, round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {totals[n]['tokens'] / totals[n]['wall']:.1f} tok/s" for n in engines))
            row = {"streams": streams, "same_tokens": same, "conditions": {}}
            for name, t in totals.items():
                row["conditions"][name] = {
                    **t, "tok_s": t["tokens"] / t["wall"],
                    "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None}
            rows.append(row)
        weights = eng0.loaded.weights
    finally:
        for eng in engines.values():
            eng.stop()
    info = backend_info()
    shown = [a for i, a in enumerate(argv)  # where the files go is not part of the run
             if a != "--out-dir" and (i == 0 or argv[i - 1] != "--out-dir")]
    data = {"command": shlex.join([".venv/bin/python", "benchmarks/speculative.py", *shown]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": info["backend"],
            "blas": blas_name(info.get("blas")) or "bundled", "weights": weights, "k": args.k,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "workload": args.workload,
            "default_max_batch": default_max_batch, "method": args.method,
            "conditions": list(engines), "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "speculative" + ("" if args.workload == "copy" else f"_{args.workload}")
    name += ("" if args.method == "ngram" else f"_{args.method}")
    name += "" if args.weights == "auto" else f"_{args.weights}"
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0 if all(r["same_tokens"] for r in rows) else 1


def render(data: dict) -> str:
    if data.get("method", "ngram") == "draft":
        return render_draft(data)
    names = list(CONDITIONS)
    workload = {"copy": "a copy-heavy workload", "open": "open questions"}[data["workload"]]
    lines = [f"# Speculative decoding (prompt lookup) on {workload}", "",
             f"`{data['command']}`, run {data['started']}: backend {data['backend']}, BLAS "
             f"{data['blas']}, weights {data['weights']}; k = {data['k']} drafts, greedy, up to "
             f"{data['max_tokens']} tokens, {data['rounds']} rounds per row, the three engines "
             f"taking turns. The default turn-down speculates while at most "
             f"{data['default_max_batch']} requests run.", "",
             "| streams | no speculation tok/s | ngram always tok/s (x) | acceptance | ngram, "
             "default turn-down tok/s (x) | same tokens |",
             "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        c = [r["conditions"][n] for n in names]
        base = c[0]["tok_s"]
        acc = "–" if c[1]["acceptance"] is None else f"{100 * c[1]['acceptance']:.0f}%"
        lines.append(f"| {r['streams']} | {base:.1f} | {c[1]['tok_s']:.1f} "
                     f"({c[1]['tok_s'] / base:.2f}x) | {acc} | {c[2]['tok_s']:.1f} "
                     f"({c[2]['tok_s'] / base:.2f}x) | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def render_draft(data: dict) -> str:
    names = data["conditions"]
    drafts = names[1:]
    workload = {"copy": "a copy-heavy workload", "open": "open questions"}[data["workload"]]
    lines = [f"# Speculative decoding with a draft model on {workload}", "",
             f"`{data['command']}`, run {data['started']}: backend {data['backend']}, BLAS "
             f"{data['blas']}, target weights {data['weights']}; k = {data['k']} drafts, greedy, "
             f"up to {data['max_tokens']} tokens, {data['rounds']} rounds per row, the engines "
             "taking turns, each draft engine speculating at every batch size. Draft share: "
             "the draft model's forwards over the wall time.", "",
             "| streams | no speculation tok/s | "
             + " | ".join(f"{n} tok/s (x) | acceptance | draft share" for n in drafts)
             + " | same tokens |",
             "|---|---|" + "---|---|---|" * len(drafts) + "---|"]
    for r in data["rows"]:
        c = r["conditions"]
        base = c["off"]["tok_s"]
        cells = []
        for n in drafts:
            x = c[n]
            acc = "–" if x["acceptance"] is None else f"{100 * x['acceptance']:.0f}%"
            cells.append(f"{x['tok_s']:.1f} ({x['tok_s'] / base:.2f}x) | {acc} | "
                         f"{100 * x['propose_time'] / x['wall']:.0f}%")
        lines.append(f"| {r['streams']} | {base:.1f} | " + " | ".join(cells)
                     + f" | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
