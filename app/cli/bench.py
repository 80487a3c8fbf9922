"""`batchscope bench serve`: benchmark any OpenAI-compatible server (see app/bench/)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from app.settings import DEFAULT_DB, ENV_API_KEY, ENV_DB, resolve_db_path

DEFAULT_CONTEXT = 2048  # when the server does not say (batchscope's /v1/models does)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_bench_command(subparsers) -> None:
    """Add `bench serve ...` to the `batchscope` subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark a server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (batchscope, mlx_lm.server, vLLM): "
                      "TTFT, TPOT, ITL, E2E latency, throughput, goodput",
        description="Streamed requests with Poisson arrivals and/or a concurrency cap; the "
                    "report follows `vllm bench serve`. Recorded in the runs database "
                    "(shown at /benchmarks) unless --no-record.")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the one the server lists, when it lists "
                        "exactly one of its own; else none, i.e. the server's default)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--num-prompts", type=_positive, default=100)
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--max-concurrency", type=_positive, default=None,
                   help="at most this many requests in flight")
    p.add_argument("--dataset", default="mixed",
                   help="'mixed' (seeded long-tailed prompt/output lengths from a built-in word "
                        "list) or a file: JSON lines with \"prompt\" and optional "
                        "\"max_tokens\", or one prompt per line")
    p.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals")
    p.add_argument("--max-tokens-cap", type=_positive, default=None,
                   help="upper bound on each request's max_tokens (mixed: default 256)")
    p.add_argument("--input-len-cap", type=_positive, default=None,
                   help="mixed: upper bound on prompt length in words (~tokens)")
    p.add_argument("--context", type=_positive, default=None,
                   help="mixed: context length to fit requests in (default: the server's "
                        f"max_model_len if it says, else {DEFAULT_CONTEXT})")
    p.add_argument("--ignore-eos", default="auto", choices=["auto", "on", "off"],
                   help="send ignore_eos so outputs run to max_tokens (auto: only to batchscope, "
                        "which supports it)")
    p.add_argument("--json-schema", metavar="FILE", default=None,
                   help="send this JSON Schema with every request (response_format json_schema; "
                        "ignore_eos stays off) and report how many outputs parsed as JSON")
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=None,
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:5000 (milliseconds)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for a response's next bytes")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as `Authorization: Bearer KEY` (default: $BATCHSCOPE_API_KEY, "
                        "else $OPENAI_API_KEY, else none)")
    p.add_argument("--label", default=None, help="a name for this run on /benchmarks")
    p.add_argument("--save-result", metavar="FILE", default=None,
                   help="write every number and the per-request data as JSON")
    rec = p.add_mutually_exclusive_group()
    rec.add_argument("--no-record", action="store_true", help="do not record in the database")
    rec.add_argument("--db", default=None,
                     help="runs database to record into: a SQLite file or a "
                          "postgresql+psycopg:// URL (default: the server's default, "
                          f"{DEFAULT_DB} or ${ENV_DB})")
    p.set_defaults(func=cmd_bench_serve)


def _fail(message: str, code: int = 1) -> int:
    print(f"batchscope bench: error: {message}", file=sys.stderr)
    return code


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from app.bench import dataset as datasets
    from app.bench.client import BenchError, choose_model, json_schema_format, probe, run_load
    from app.bench.metrics import format_report, parse_goodput, summarize
    from app.bench.progress import Progress
    from app.db.benchmarks import save_run
    from app.db.database import DatabaseError, open_database

    # One line per request from httpx would drown the progress counter and the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        return _fail(str(e), 2)
    request_rate = None if math.isinf(args.request_rate) else args.request_rate
    response_format = None
    if args.json_schema is not None:
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, ValueError) as e:
            return _fail(f"--json-schema {args.json_schema}: {e}", 2)
        if not isinstance(schema, dict):
            return _fail(f"--json-schema {args.json_schema}: not a JSON object", 2)
        if args.ignore_eos == "on":
            return _fail("--json-schema and --ignore-eos on: a schema's output ends where the "
                         "schema does", 2)
        response_format = json_schema_format(schema)

    db = None
    if not args.no_record:
        db_path = resolve_db_path(args.db)
        try:
            db = open_database(db_path)  # fails before the run, not after it
        except DatabaseError as e:
            return _fail(f"{e} (--no-record skips recording)")
    try:
        api_key = (args.api_key or os.environ.get(ENV_API_KEY)
                   or os.environ.get("OPENAI_API_KEY") or None)
        try:
            info = probe(args.url, api_key=api_key)
        except BenchError as e:
            return _fail(str(e))
        context = args.context or info.max_model_len or DEFAULT_CONTEXT
        try:
            requests = datasets.load(args.dataset, args.num_prompts, seed=args.seed,
                                     context=context, max_tokens_cap=args.max_tokens_cap,
                                     input_len_cap=args.input_len_cap)
        except (ValueError, FileNotFoundError) as e:
            return _fail(str(e), 2)
        model = choose_model(info, args.model)
        ignore_eos = args.ignore_eos == "on" or (args.ignore_eos == "auto" and info.is_batchscope
                                                 and response_format is None)
        limit = "unlimited" if args.max_concurrency is None else args.max_concurrency
        rate = "inf" if request_rate is None else f"{request_rate:g}/s"
        print(f"Benchmarking {info.base_url} ({model or 'server default model'}, "
              f"/v1/{'chat/' if args.endpoint == 'chat' else ''}completions): "
              f"{len(requests)} requests from {args.dataset!r}, rate {rate}, "
              f"concurrency {limit}, ignore_eos {'on' if ignore_eos else 'off'}"
              + (f", JSON schema {args.json_schema}" if response_format else ""),
              file=sys.stderr)
        progress = Progress(len(requests))
        created = time.time()
        results, duration = asyncio.run(run_load(
            info.base_url, requests, endpoint=args.endpoint, model=model,
            request_rate=request_rate, max_concurrency=args.max_concurrency,
            ignore_eos=ignore_eos, seed=args.seed, timeout=args.timeout, api_key=api_key,
            response_format=response_format, on_done=lambda r: progress.update(r.success)))
        summary = summarize(results, duration, slos)
        print(format_report(summary, request_rate=request_rate,
                            max_concurrency=args.max_concurrency))
        config = {"ignore_eos": ignore_eos, "max_tokens_cap": args.max_tokens_cap,
                  "input_len_cap": args.input_len_cap, "context": context,
                  "timeout": args.timeout, "goodput": slos or None,
                  "server_owned_by": info.owned_by, "server_models": info.models,
                  "json_schema": response_format and response_format["json_schema"]["schema"]}
        per_request = [r.to_dict() for r in results]
        dataset_name = args.dataset if args.dataset == "mixed" else Path(args.dataset).name
        record = dict(url=info.base_url, model=model or "(server default)",
                      endpoint=args.endpoint, dataset=dataset_name,
                      num_prompts=len(requests), request_rate=request_rate,
                      max_concurrency=args.max_concurrency, seed=args.seed, summary=summary,
                      requests=per_request, config=config, label=args.label,
                      created_at=created)
        run_id = None
        if db is not None:
            try:
                run_id = save_run(db, **record)
            except DatabaseError as e:
                print(f"batchscope bench: warning: {e}", file=sys.stderr)
            else:
                print(f"Recorded as benchmark run {run_id} in {db.path} (see /benchmarks)",
                      file=sys.stderr)
        if args.save_result:
            out = {"benchmark_id": run_id, "date": created, **record}
            out["request_rate"] = request_rate  # null: all at once (inf)
            try:
                Path(args.save_result).write_text(
                    json.dumps(out, indent=2, allow_nan=False, default=str) + "\n")
            except (OSError, ValueError) as e:
                return _fail(f"cannot write {args.save_result}: {e}")
            print(f"Wrote {args.save_result}", file=sys.stderr)
        if summary["completed"] == 0:
            first = next((r.error for r in results if r.error), "no error text")
            return _fail(f"every request failed; the first said: {first}")
        return 0
    finally:
        if db is not None:
            db.close()
