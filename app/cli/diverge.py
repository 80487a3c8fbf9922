"""`batchscope diverge`: one prompt, greedily, on two set-ups (sides A and B); where the outputs
part, the logits at the fork, and which cache write started it (app/lab/divergence.py).

A side is a comma-separated list of key=value settings:

  weights=f32|q4|bf16|auto       weight format (default: --weights)
  policy=gemm|gemv|auto          kernel path of each step's linear layers
  threshold=N                    with policy=auto: row-wise at or below N rows in a step
  alongside=120,60,30            other requests (prompt lengths in tokens) sharing the batch
  join=K                         they join at the step computing the target's token #K
                                 (0, the default: together with the target's prompt)
  others_tokens=N                tokens each other request generates (default 16)
  speculative=off|ngram|draft, k=N
                                 speculative decoding (prompt lookup, or a draft model's
                                 greedy tokens; N drafts a step), on whatever shares the batch
  draft=layers:N|embedded|PATH   with speculative=draft: the draft model (default:
                                 --draft-model), as the engine's --draft-model takes it
  max_batched=N, max_seqs=N, block_size=N, batch_invariant=1   engine settings

examples:
  # batched GEMM against row-wise GEMV, the target alone on both sides
  batchscope diverge "Once upon a time" --a policy=gemm --b policy=gemv
  # alone against alongside three other requests, mixed steps GEMM, single rows GEMV
  batchscope diverge "Once upon a time" --a policy=auto,threshold=1 \\
      --b policy=auto,threshold=1 --b-alongside 120,60,30
  # the mini-vllm-rs case: a 120-token prompt joins while the target decodes
  batchscope diverge "Once upon a time" --a policy=auto,threshold=4 \\
      --b policy=auto,threshold=4,alongside=120,join=8
  # serial admission vs continuous batching for a speculating request: a 120-token prompt's
  # prefill joins while the target verifies its drafts (float32: mixed steps take BLAS GEMM)
  batchscope diverge --chat "Repeat exactly: ..." --weights f32 --a speculative=ngram \
      --b speculative=ngram,alongside=120,join=4
  # prompt lookup against the target's first 8 layers drafting for it, both q4
  batchscope diverge "Once upon a time" --weights q4 --draft-model layers:8 \
      --a speculative=ngram,k=4 --b speculative=draft,k=4
  # how often does it fork here? 20 built-in prompts, or one prompt a line from FILE
  batchscope diverge --search --a policy=gemm --b policy=gemv
  # save it in the server's runs database: listed at /divergence, its sides at /runs
  batchscope diverge "Once upon a time" --a policy=gemm --b policy=gemv --db batchscope.db
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

from engine.config import WEIGHT_FORMATS


def add_diverge_command(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "diverge", help="run a prompt on two set-ups and trace where the outputs fork",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the target prompt (not with --search)")
    p.add_argument("--a", default="policy=gemm", metavar="SPEC",
                   help="side A settings (default: policy=gemm)")
    p.add_argument("--b", default="policy=gemv", metavar="SPEC",
                   help="side B settings (default: policy=gemv)")
    p.add_argument("--a-alongside", metavar="N,N,...", default=None,
                   help="side A: prompt lengths of other requests (same as alongside=...)")
    p.add_argument("--b-alongside", metavar="N,N,...", default=None,
                   help="side B: prompt lengths of other requests")
    p.add_argument("--weights", default="f32", choices=WEIGHT_FORMATS,
                   help="weights of both sides unless a spec says otherwise (default f32: on "
                        "a CPU, 4-bit rows are computed alike on every path)")
    p.add_argument("--model", default="embedded", help="'embedded' or an mlx-lm model folder")
    p.add_argument("--draft-model", default=None, metavar="SPEC",
                   help="the draft model of sides with speculative=draft unless a side says "
                        "draft=...: layers:N (the target's first N layers), 'embedded' (4-bit) "
                        "or an mlx-lm folder with the target's tokenizer")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per side")
    p.add_argument("--top-k", type=int, default=5, help="tokens per side in the fork table")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end at EOS (default: ignore it, so both sides run --max-tokens)")
    p.add_argument("--search", nargs="?", const="", default=None, metavar="FILE",
                   help="run many prompts: the 20 built-in ones, or one a line from FILE (a "
                        "line that is a JSON string may hold \\n)")
    p.add_argument("--limit", type=int, default=None, help="with --search: the first N only")
    p.add_argument("--all-tokens", action="store_true",
                   help="print every compared token's logit row (default: the telling ones)")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument("--db", default=None, metavar="PATH",
                   help="also save the experiment (its record, and its two sides as runs) in "
                        "this SQLite runs database, e.g. the server's ./batchscope.db, to see "
                        "it at /divergence (default: not saved; not with --search)")
    p.set_defaults(func=cmd_diverge)
    return p


def sides(args: argparse.Namespace) -> tuple[Any, Any]:
    from app.lab.divergence import SideConfig

    base = SideConfig(weights=args.weights, draft_model=args.draft_model)
    out = []
    for spec, extra in ((args.a, args.a_alongside), (args.b, args.b_alongside)):
        if extra is not None:
            spec = f"{spec},alongside={extra}"
        out.append(SideConfig.parse(spec, base))
    return out[0], out[1]


def cmd_diverge(args: argparse.Namespace) -> int:
    from app.lab.divergence import BUILTIN_PROMPTS, load_prompts, run_experiment, search

    a, b = sides(args)

    def progress(message: str) -> None:
        print(f"diverge: {message}", file=sys.stderr, flush=True)

    common = {"max_tokens": args.max_tokens, "top_k": args.top_k, "progress": progress,
              "model": args.model, "chat": args.chat, "ignore_eos": not args.stop_at_eos}
    if args.search is not None:
        if args.prompt:
            raise ValueError("give either a prompt or --search, not both")
        if args.db is not None:
            raise ValueError("--db saves one experiment: give a prompt, not --search")
        prompts = load_prompts(args.search) if args.search else list(BUILTIN_PROMPTS)
        if args.limit:
            prompts = prompts[:args.limit]
        result = search(prompts, a, b, **common)
        print(json.dumps(result, ensure_ascii=False) if args.json
              else format_search(result, args.all_tokens))
        return 0
    if not args.prompt:
        raise ValueError("a prompt is required (or --search)")
    if args.db is None:
        record = run_experiment(args.prompt, a, b, **common)
        print(json.dumps(record, ensure_ascii=False) if args.json
              else format_record(record, args.all_tokens))
        return 0
    return _run_and_save(args, a, b, common)


def _run_and_save(args: argparse.Namespace, a: Any, b: Any, common: dict) -> int:
    """One experiment, saved as the web page saves one (app/db/experiments.py), failed or
    not. The database is opened first, so a bad path fails before the model loads."""
    from app.db.database import DatabaseError, open_database
    from app.lab.divergence import run_experiment

    try:
        db = open_database(args.db)
    except DatabaseError as e:
        print(f"batchscope diverge: error: {e}", file=sys.stderr)
        return 2
    now = time.time()
    entry = {"id": f"div-cli-{uuid.uuid4().hex[:12]}", "status": "done", "created": now,
             "started": now, "finished": None, "record": None, "error": None,
             "params": {"prompt": args.prompt, "max_tokens": args.max_tokens,
                        "top_k": args.top_k, "chat": args.chat, "a": a.to_dict(),
                        "b": b.to_dict(), "model": args.model,
                        "ignore_eos": common["ignore_eos"]}}
    with db:
        try:
            entry["record"] = run_experiment(args.prompt, a, b, **common)
        except Exception as e:
            entry.update(status="error", error=f"{type(e).__name__}: {e}", finished=time.time())
            _save(db, entry)
            raise
        entry["finished"] = time.time()
        print(json.dumps(entry["record"], ensure_ascii=False) if args.json
              else format_record(entry["record"], args.all_tokens))
        return 0 if _save(db, entry) else 1


def _save(db: Any, entry: dict) -> bool:
    from app.db.database import DatabaseError
    from app.db.experiments import save_experiment

    try:
        save_experiment(db, entry, origin="cli")
    except DatabaseError as e:
        print(f"batchscope diverge: error: not saved: {e}", file=sys.stderr)
        return False
    print(f"diverge: saved as experiment {entry['id']} in {db.path} "
          f"(/divergence?id={entry['id']})", file=sys.stderr)
    return True


# ---- text output ---------------------------------------------------------------------------
def clean(text: str | None) -> str:
    """Model output on a terminal: control characters (escape sequences) made visible."""
    if text is None:
        return ""
    return "".join(ch if ch in "\n\t" or (ord(ch) >= 32 and ord(ch) != 127)
                   else f"\\x{ord(ch):02x}" for ch in text)


def token_repr(text: str | None) -> str:
    return "—" if text is None else repr(text)


def g(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{x:.{digits}g}")


def _writer(w: dict | None, steps: list | None = None) -> str:
    if w is None:
        return "—"
    first, last = steps or (w["step"], w["step"])
    step = str(first) if first == last else f"{first}–{last}"
    return f"{step:>7} {w['path']:<5} {w['step_rows']:>4}"


def _where(first: int, last: int, prompt_tokens: int) -> str:
    def one(p: int) -> str:
        return "prompt" if p < prompt_tokens else f"out #{p - prompt_tokens}"

    if first == last:
        return one(first)
    if last < prompt_tokens:
        return "prompt"
    return f"{one(first)}–{one(last).removeprefix('out ')}"


def _speculation_lines(r: dict) -> list[str]:
    out = []
    for name in ("a", "b"):
        s = r["sides"][name].get("speculation")
        if s:
            rate = "–" if s["acceptance"] is None else f"{100 * s['acceptance']:.1f}%"
            by = f" from {s['draft_model']}" if s.get("draft_model") else ""
            out.append(f"{name.upper()} drafts{by}: {s['accepted']} of {s['drafted']} accepted "
                       f"({rate}) over {s['verify_steps']} verify steps")
    return out


def format_record(r: dict, all_tokens: bool = False) -> str:
    from app.lab.divergence import timeline
    from engine.platform import blas_name

    a, b = r["sides"]["a"], r["sides"]["b"]
    blas = blas_name(r.get("backend", {}).get("blas")) or "bundled"
    out = [f"model {r['model']} · prompt {r['prompt_tokens']} tokens · "
           f"{r.get('max_tokens', '?')} new tokens · greedy · BLAS {blas}",
           f"A: {a['label']}", f"B: {b['label']}", *_speculation_lines(r), "",
           f"Verdict: {r['verdict']}", "", "Cause → fork:"]
    out += [f"  {i + 1}. {line}" for i, line in enumerate(r["chain"])]
    fork = r["fork"]
    if fork is not None:
        out += ["", f"Shared text ({fork['char_offset']} characters):",
                _indent(clean(fork["shared_text"])),
                "A continues:", _indent(clean(fork["continuation_a"])),
                "B continues:", _indent(clean(fork["continuation_b"]))]
        if fork["table"]:
            out += ["", f"Logits at the fork (output token {fork['token_index']}; * = chosen):",
                    f"  {'token':>7}  {'text':<16} {'A logit':>12} {'B logit':>12} "
                    f"{'B − A':>10}  {'rank A':>6}  {'rank B':>6}"]
            for row in fork["table"]:
                mark_a = "*" if row["token_id"] == fork["token_a"] else " "
                mark_b = "*" if row["token_id"] == fork["token_b"] else " "
                out.append(f"  {row['token_id']:>7}  {clean(repr(row['text'])):<16.16} "
                           f"{row['logit_a']:>12.6f} {row['logit_b']:>12.6f} "
                           f"{row['delta']:>+10.6f}  {row['rank_a']:>5}{mark_a}  "
                           f"{row['rank_b']:>5}{mark_b}")
            out.append(f"  top-2 margin: A {g(fork['margin_a'], 4)}, B {g(fork['margin_b'], 4)}")
    else:
        out += ["", "Text (both sides):", _indent(clean(a["text"]))]

    logits = r["logits"]
    out += ["", f"Logits token by token while the sides agree ({logits['compared_tokens']} "
                "tokens):",
            f"  {'token':>5}  {'A step path rows':>18}  {'B step path rows':>18}  "
            f"{'max|Δlogit|':>11}  {'margin A':>9}  {'margin B':>9}"]
    rows = logits["per_token"]
    shown = _telling(r) if not all_tokens and len(rows) > 20 else set(range(len(rows)))
    previous = -1
    for p in rows:
        if p["index"] not in shown:
            continue
        if p["index"] != previous + 1:
            out.append("  …")
        previous = p["index"]
        flag = " ← fork" if fork and p["index"] == fork["token_index"] else ""
        out.append(f"  {p['index']:>5}  {p['step_a']:>7} {p['path_a']:<5} {p['rows_a']:>4}  "
                   f"{p['step_b']:>7} {p['path_b']:<5} {p['rows_b']:>4}  "
                   f"{g(p['max_abs_delta']):>11}  {g(p['margin_a'], 4):>9}  "
                   f"{g(p['margin_b'], 4):>9}{flag}")
    if previous != len(rows) - 1 and rows:
        out.append("  …")

    kv = r["kv"]
    out += ["", f"Contamination timeline: keys/values compared at {kv['compared_positions']} "
                "positions (* = first difference)",
            f"  {'positions':>9}  {'what':<14} {'A step path rows':>18}  "
            f"{'B step path rows':>18}  {'max|ΔKV|':>9}"]
    first = kv["first_difference"]
    for row in timeline(r):
        span = str(row["first"]) if row["first"] == row["last"] else \
            f"{row['first']}–{row['last']}"
        star = " *" if first and row["first"] <= first["position"] <= row["last"] else ""
        out.append(f"  {span:>9}  {_where(row['first'], row['last'], r['prompt_tokens']):<14.14} "
                   f"{_writer(row['a'], row['steps_a'])}  {_writer(row['b'], row['steps_b'])}  "
                   f"{g(row['max_abs_delta']):>9}{star}")
    if first:
        layers = first["max_abs_delta_per_layer"]
        out.append(f"  at position {first['position']}: max |ΔK| {g(first['keys_max_abs_delta'])}, "
                   f"max |ΔV| {g(first['values_max_abs_delta'])}; per layer: "
                   + " ".join(g(x, 2) for x in layers))
    return "\n".join(out)


def _telling(r: dict) -> set[int]:
    """Token rows worth printing: the first logit difference, the nearest ties, the last ones."""
    rows = r["logits"]["per_token"]
    keep = {0, len(rows) - 1}
    if r["logits"]["first_difference"] is not None:
        keep.add(r["logits"]["first_difference"])
    nearest = sorted(rows, key=lambda p: min(p["margin_a"], p["margin_b"]))[:3]
    keep.update(p["index"] for p in nearest)
    keep.update(range(max(0, len(rows) - 5), len(rows)))
    return keep


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text or "(empty)").split("\n"))


def format_search(s: dict, all_tokens: bool = False) -> str:
    out = [f"search: {s['prompts']} prompts × {s['max_tokens']} tokens",
           f"A: {s['a']['label']}", f"B: {s['b']['label']}", "",
           f"  {'#':>3}  {'fork at':>7}  {'margin A/B at fork':>19}  {'min margin (token)':>19}  "
           f"{'max|Δlogit|':>11}  {'KV first Δ':>10}  prompt"]
    for x in s["results"]:
        prompt = clean(x["prompt"]).replace("\n", "↵")[:40]
        if "error" in x:
            out.append(f"  {x['index'] + 1:>3}  error: {x['error'][:80]}  {prompt}")
            continue
        fork = "—" if x["fork_index"] is None else str(x["fork_index"])
        at_fork = "—" if x["fork_index"] is None else \
            f"{g(x['fork_margin_a'], 3)}/{g(x['fork_margin_b'], 3)}"
        m = x["min_margin"]
        near = "—" if m is None else f"{m['value']:.3g} (t{m['index']})"
        kv = "—" if x["kv_first_difference"] is None else f"pos {x['kv_first_difference']}"
        out.append(f"  {x['index'] + 1:>3}  {fork:>7}  {at_fork:>19}  {near:>19}  "
                   f"{g(x['max_abs_dlogit']):>11}  {kv:>10}  {prompt}")
    ok = s["prompts"] - s["errors"]
    indices = ", ".join(str(i) for i in s["fork_indices"])
    out += ["", f"Forked: {s['forked']} of {ok}" + (f" (at tokens {indices})" if indices else "")
            + f" · same tokens, numbers differ: {s['same_tokens_numbers_differ']}"
            f" · bit-identical: {s['bit_identical']}"
            + (f" · errors: {s['errors']}" if s["errors"] else "")]
    out.append(f"Tokens compared: {s['tokens_compared']}; close calls (top-2 margin within 10x "
               f"that token's max |Δlogit|): {s['close_calls']}")
    if s["smallest_margins"]:
        out.append("Smallest top-2 margins seen: " + ", ".join(
            f"{m['margin']:.4g} (prompt {m['prompt_index'] + 1}, token {m['token_index']}"
            + (", forked" if m["forked_here"] else "") + ")" for m in s["smallest_margins"][:5]))
    if s["forks"]:
        out += ["", "First fork in detail:", "", format_record(s["forks"][0], all_tokens)]
    return "\n".join(out)
