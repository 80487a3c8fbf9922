"""`batchscope generate PROMPT`: one request, streamed to the terminal (or --json)."""

from __future__ import annotations

import argparse
import json
import sys

from app.cli.engine_flags import add_engine_args, engine_config, run_launched_rank


def add_generate_command(sub: argparse._SubParsersAction) -> None:
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



def cmd_generate(args: argparse.Namespace) -> int:
    from app.lab.calibration import saved_thresholds
    from engine.engine import Engine
    from engine.events import FinishEvent, TokenEvent
    from engine.sampling import SamplingParams

    launched = run_launched_rank(args)  # mlx.launch: ranks > 0 serve rank 0's plans
    if launched is not None:
        return launched
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop or ()), logprobs=args.logprobs,
                            ignore_eos=args.ignore_eos)
    with Engine(engine_config(args), thresholds=saved_thresholds()).start() as engine:
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
                               "logprob": event.logprob, "top_logprobs": event.top_logprobs,
                               "drafted": event.drafted})
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
        drafted = (f", {sum(t['drafted'] for t in tokens)} of them accepted drafts"
                   if engine.speculation.enabled else "")
        print(f"[{finish.reason}] {finish.completion_tokens} tokens in {elapsed:.2f} s, "
              f"TTFT {ttft * 1000:.0f} ms{drafted}", file=sys.stderr)
    return 0 if finish.reason != "error" else 1
