"""What speculation costs a hybrid model when its drafts fail: one stream's output tokens/s with
every draft wrong, against no speculation, on the same random-weight folder.

    .venv/bin/python benchmarks/hybrid_speculative.py [--family qwen3_5-135m] [--weights q4]
        [--k 4] [--max-tokens 64] [--rounds 3]

A verify step of a hybrid runs the drafts through every GDN layer and keeps the state after
each row in a scratch slot, so a rejected draft costs its rows and the snapshots. Prompt
lookup seldom drafts on a random model, so the failing drafts come from a proposer that
drafts on purpose: ScriptedDrafts(wrong=1) knows each request's greedy continuation (from the
plain engine's run of the same prompt in the same round) and drafts it with every token
changed, so every step
verifies k drafts and keeps none. A third engine runs prompt lookup as it ships
(speculative="ngram", prompt_lookup_min=1) to show how often it drafts here at all. The
engines take turns per round, one request at a time (greedy, no EOS stop); all must give the
same tokens, and drafted / accepted counts come from the step records. Writes
benchmarks/results/hybrid_speculative[_WEIGHTS].md and .json.
"""

from __future__ import annotations

import argparse
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
from engine_batching import make_prompts
from families import CONFIGS, make_folder
from llama_cpp_peer import log
# isort: on

from engine.config import EngineConfig
from engine.engine import Engine, Submission
from engine.platform import backend_info, blas_name
from engine.sampling import SamplingParams
from engine.testing import FAMILY_VOCAB, ScriptedDrafts


def run(eng: Engine, ids: list[int], max_tokens: int) -> dict:
    first_step = eng.step_count + 1
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    result = eng.submit_many([Submission(ids, params)])[0].result()
    wall = time.perf_counter() - t0
    steps = [r for r in eng.steps.recent() if r.step >= first_step]
    return {"wall": wall, "tokens": result.token_ids, "tok_s": len(result.token_ids) / wall,
            "drafted": sum(r.draft_tokens for r in steps),
            "accepted": sum(r.accepted_tokens for r in steps),
            "verify_steps": sum(1 for r in steps if r.verify_rows), "steps": len(steps)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen3_5-135m", choices=[*sorted(CONFIGS), "embedded"],
                    help="embedded: the embedded model (dense, the same size and vocabulary) "
                    "under the same drafts, for comparison")
    ap.add_argument("--weights", default="q4", choices=["q4", "f32"])
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = ("embedded" if args.family == "embedded"
                  else str(make_folder(Path(tmp), args.family, args.weights)))
        base = {"model": folder, "weights": args.weights, "max_num_seqs": 1,
                "num_speculative_tokens": args.k}
        plain = Engine(EngineConfig(**base)).start()
        proposer = ScriptedDrafts(wrong=1, vocab=FAMILY_VOCAB)  # every draft wrong
        engines = {"off": plain,
                   "wrong drafts": Engine(EngineConfig(speculative="ngram", **base),
                                          proposer=proposer).start(),
                   "prompt lookup (min 1)": Engine(EngineConfig(
                       speculative="ngram", prompt_lookup_min=1, **base)).start()}
        try:
            prompts = make_prompts(plain.tokenizer, args.rounds + 1)
            log("warm-up")
            proposer.learn(prompts[-1], run(plain, prompts[-1], 8)["tokens"])
            for eng in engines.values():
                run(eng, prompts[-1], 8)
            rounds = []
            for r in range(args.rounds):
                ids = prompts[r]
                row = {"off": run(plain, ids, args.max_tokens)}
                proposer.learn(ids, row["off"]["tokens"])
                for name, eng in engines.items():
                    if name != "off":
                        row[name] = run(eng, ids, args.max_tokens)
                rounds.append(row)
                log(f"round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {w['tok_s']:.1f} tok/s ({w['accepted']}/{w['drafted']} kept)"
                    for n, w in row.items()))
        finally:
            for eng in engines.values():
                eng.stop()
    same = all(len({json.dumps(w["tokens"]) for w in row.values()}) == 1 for row in rounds)
    conditions = {}
    for name in engines:
        runs = [row[name] for row in rounds]
        conditions[name] = {
            "tok_s": statistics.median(w["tok_s"] for w in runs),
            "ratio": statistics.median(w["tok_s"] / row["off"]["tok_s"]
                                       for w, row in zip(runs, rounds, strict=True)),
            "ratio_range": [min(w["tok_s"] / row["off"]["tok_s"]
                                for w, row in zip(runs, rounds, strict=True)),
                            max(w["tok_s"] / row["off"]["tok_s"]
                                for w, row in zip(runs, rounds, strict=True))],
            **{key: sum(w[key] for w in runs) for key in ("drafted", "accepted",
                                                          "verify_steps", "steps")}}
    for row in rounds:
        for w in row.values():
            del w["tokens"]
    info = backend_info()
    shown = [a for i, a in enumerate(argv)  # where the files go is not part of the run
             if a != "--out-dir" and (i == 0 or argv[i - 1] != "--out-dir")]
    data = {"command": shlex.join([".venv/bin/python", "benchmarks/hybrid_speculative.py",
                                   *shown]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": info["backend"],
            "blas": blas_name(info.get("blas")) or "bundled", "family": args.family,
            "weights": args.weights, "k": args.k, "max_tokens": args.max_tokens,
            "same_tokens": same, "conditions": conditions, "rounds": rounds}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "hybrid_speculative" + ("" if args.weights == "q4" else f"_{args.weights}")
    if args.family == "embedded":
        name += "_embedded"
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / f"{name}.md").write_text(text)
    print(text)
    return 0 if same else 1


def render(data: dict) -> str:
    lines = [
        f"# Speculation when the drafts fail: {data['family']}", "",
        f"`{data['command']}`, run {data['started']}: backend {data['backend']}, BLAS "
        f"{data['blas']}; {data['family']} ({data['weights']}"
        f"{'' if data['family'] == 'embedded' else ', random weights'}), one stream, "
        f"k = {data['k']}, {data['max_tokens']} greedy tokens per request, "
        f"{len(data['rounds'])} rounds, the engines taking turns. Ratio: tokens/s over the "
        "same round's run without speculation (median, lowest-highest round in brackets). "
        "Drafted and kept: totals over the rounds, from the step records. Same tokens in "
        f"every condition: {'yes' if data['same_tokens'] else 'NO'}.", "",
        "| speculation | tok/s | ratio | verify steps / steps | drafted | kept |",
        "|---|---|---|---|---|---|"]
    for name, c in data["conditions"].items():
        lo, hi = c["ratio_range"]
        lines.append(f"| {name} | {c['tok_s']:.1f} | {c['ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                     f"{c['verify_steps']} / {c['steps']} | {c['drafted']} | {c['accepted']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
