"""Benchmark requests: a seeded long-tailed mix of prompt and output lengths, or a file.

Prompts of the `mixed` dataset are built from a built-in list of common English words, so
nothing is downloaded. Lengths are counted in words; for BPE tokenizers such as SmolLM2's each
of these words (with its leading space) is about one token, and the report uses the server's
own token counts where it gives them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from his her he she it they we you "
    "this are be had have not but or an were which their one all there been has when who will "
    "more no if out so up said what its about into than them can only other new some time "
    "could these two may first then do any like my now over such our man me even most made "
    "after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three house "
    "water room mother night light river city story small world place hand part child eye "
    "woman case week company system program question number point home government school "
    "family group country problem fact money lot study book job word business issue side kind "
    "head friend power hour game line end member law car name president team minute idea body "
    "information back parent face others level office door health person art war history "
    "party result change morning reason research girl guy moment air teacher force education"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # each word once

# Long-tailed defaults (medians, in words ~ tokens) for the mixed dataset.
INPUT_MEDIAN = 128
INPUT_SIGMA = 1.0
OUTPUT_MEDIAN = 64
OUTPUT_SIGMA = 0.9
MIN_INPUT = 4


def token_budget(context: int) -> int:
    """Prompt + output words allowed in a context: room is left for what the server adds
    around the prompt (chat template, BOS) and for words that take more than one token (each
    of WORDS is one token for SmolLM2's tokenizer)."""
    return context - max(64, context // 8)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    input_len: int  # words (mixed) or whitespace-separated words (file): an estimate of tokens

    def to_dict(self) -> dict:
        return asdict(self)


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=n))


def mixed(num_prompts: int, *, seed: int = 0, context: int = 2048, max_tokens_cap: int = 256,
          input_len_cap: int | None = None, input_median: int = INPUT_MEDIAN,
          output_median: int = OUTPUT_MEDIAN) -> list[BenchRequest]:
    """`num_prompts` requests with lognormal prompt and output lengths, clipped to the context.

    The same arguments always give the same requests. Every request satisfies
    MIN_INPUT <= input_len, 1 <= max_tokens <= max_tokens_cap, and
    input_len + max_tokens <= token_budget(context).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if max_tokens_cap < 1:
        raise ValueError(f"max_tokens_cap must be at least 1, got {max_tokens_cap}")
    budget = token_budget(context)
    if budget < MIN_INPUT + 1:
        raise ValueError(f"a context of {context} tokens is too small for the mixed dataset")
    rng = np.random.default_rng(seed)
    inputs = rng.lognormal(math.log(input_median), INPUT_SIGMA, size=num_prompts)
    outputs = rng.lognormal(math.log(output_median), OUTPUT_SIGMA, size=num_prompts)
    in_cap = budget - 1 if input_len_cap is None else min(input_len_cap, budget - 1)
    if in_cap < MIN_INPUT:
        raise ValueError(f"input_len_cap must be at least {MIN_INPUT}, got {input_len_cap}")
    requests = []
    for raw_in, raw_out in zip(inputs, outputs, strict=True):
        n_in = int(min(max(round(raw_in), MIN_INPUT), in_cap))
        n_out = int(min(max(round(raw_out), 1), max_tokens_cap, budget - n_in))
        requests.append(BenchRequest(_words(rng, n_in), n_out, n_in))
    return requests


def from_file(path: str | Path, num_prompts: int, *, seed: int = 0,
              default_max_tokens: int = 128, max_tokens_cap: int | None = None
              ) -> list[BenchRequest]:
    """Requests from a file: JSON lines with "prompt" (and optional "max_tokens"), or plain
    text with one prompt per non-empty line.

    With more prompts asked for than the file holds, it is cycled; with fewer, the first
    `num_prompts` are taken (in file order: the seed does not reorder a file).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"dataset file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read dataset file {path}: {e}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"dataset file {path} has no prompts")
    is_jsonl = lines[0].lstrip().startswith("{")
    items: list[BenchRequest] = []
    for number, line in enumerate(lines, 1):
        if is_jsonl:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f'{path}:{number}: expected an object with a "prompt" string')
            max_tokens = obj.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f"{path}:{number}: max_tokens must be a positive integer")
        else:
            prompt, max_tokens = line, default_max_tokens
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        items.append(BenchRequest(prompt, max_tokens, len(prompt.split())))
    return [items[i % len(items)] for i in range(num_prompts)]


def load(spec: str, num_prompts: int, *, seed: int = 0, context: int = 2048,
         max_tokens_cap: int | None = None, input_len_cap: int | None = None
         ) -> list[BenchRequest]:
    """`mixed` or a file path."""
    if spec == "mixed":
        return mixed(num_prompts, seed=seed, context=context,
                     max_tokens_cap=max_tokens_cap or 256, input_len_cap=input_len_cap)
    return from_file(spec, num_prompts, seed=seed, max_tokens_cap=max_tokens_cap)
