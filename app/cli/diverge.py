"""`batchscope diverge`: one prompt, greedily, on two set-ups (sides A and B); where the outputs
part, the logits at the fork, and which cache write started it (app/lab/divergence/).

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
  activations=float32|int8       what the 4/8-bit linear layers multiply (int8: 8-bit
                                 activations and integer dot products, faster)
  max_batched=N, max_seqs=N, block_size=N, batch_invariant=1   engine settings

examples:
  # what 8-bit activations change against float32 ones, on the shipped 4-bit weights
  batchscope diverge "Once upon a time" --weights q4 --a activations=float32 --b activations=int8
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
    p.add_argument("--db", default=None, metavar="PATH|URL",
                   help="also save the experiment (its record, and its two sides as runs) in "
                        "this runs database, a SQLite file (e.g. the server's ./batchscope.db) "
                        "or a postgresql+psycopg:// URL, to see it at /divergence (default: not "
                        "saved; not with --search)")
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
    from app.lab.divergence.text import format_search

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
        print(json.dumps(result.to_dict(), ensure_ascii=False) if args.json
              else format_search(result, args.all_tokens))
        return 0
    if not args.prompt:
        raise ValueError("a prompt is required (or --search)")
    if args.db is None:
        _print_record(run_experiment(args.prompt, a, b, **common), args)
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
        _print_record(entry["record"], args)
        return 0 if _save(db, entry) else 1


def _print_record(record: Any, args: argparse.Namespace) -> None:
    from app.lab.divergence.text import format_record

    print(json.dumps(record.to_dict(), ensure_ascii=False) if args.json
          else format_record(record, args.all_tokens))


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
