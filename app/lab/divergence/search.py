"""Many prompts on the same two sides: how often and where they fork, and the nearest ties."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.lab.divergence.record import DivergenceRecord, SearchSummary
from app.lab.divergence.runner import DivergenceRunner, Loader, Progress, backend
from app.lab.divergence.sides import SideConfig
from engine.engine import EngineError

# Varied prompts for search(): stories, facts, code, lists, numbers, dialogue.
BUILTIN_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The mechanic and the archivist entered the abandoned lunar greenhouse, following the "
    "distress signal. Mara",
    "Explain in simple terms why the sky is blue.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three most important inventions of the nineteenth century were",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "Q: What is the capital of Australia?\nA:",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "The history of the Roman Empire can be divided into",
    "In machine learning, overfitting happens when",
    "List of tips for a good night's sleep:\n1.",
    "The detective looked at the muddy footprints and said,",
    "To install the package, first open a terminal and",
    "Photosynthesis is the process by which plants",
    "The year was 2087, and the last library on Earth",
    "SELECT name, COUNT(*) FROM orders",
    "My favourite season is autumn because",
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain",
    "Alice: Did you finish the report?\nBob:",
]



def load_prompts(path: str | Path) -> list[str]:
    """One prompt per line (blank lines skipped); a line that is a JSON string is decoded, so a
    prompt can hold newlines: "line one\\nline two"."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, str):
                line = value
        prompts.append(line)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def search(prompts: list[str] | None, a: SideConfig, b: SideConfig, max_tokens: int = 64,
           loader: Loader = None, top_k: int = 5, progress: Progress = None, *,
           model: str = "embedded", chat: bool = False, ignore_eos: bool = True,
           keep: int = 5) -> SearchSummary:
    """Run many prompts (None: BUILTIN_PROMPTS) on both sides: how often and where they fork,
    and the nearest ties seen. Full records are kept for the forks (the first `keep`)."""
    prompts = list(prompts or BUILTIN_PROMPTS)
    report = progress or (lambda message: None)
    results: list[dict] = []
    forks: list[DivergenceRecord] = []
    near: list[dict] = []
    t0 = time.perf_counter()
    with DivergenceRunner(loader, model, None) as runner:
        runner.reserve(prompts, [a, b], max_tokens, chat)
        for n, prompt in enumerate(prompts):
            report(f"[{n + 1}/{len(prompts)}] {prompt[:50]!r}")
            try:
                r = runner.run(prompt, a, b, max_tokens, top_k=top_k, chat=chat,
                               ignore_eos=ignore_eos)
            except (ValueError, EngineError) as e:
                results.append({"index": n, "prompt": prompt, "error": str(e)})
                report(f"    error: {e}")
                continue
            results.append(_result(n, prompt, r))
            m, fork = r.logits.min_margin, r.fork
            if m is not None:
                near.append({"prompt_index": n, "token_index": m.index, "side": m.side,
                             "margin": m.value,
                             "forked_here": bool(fork and fork.token_index == m.index)})
            if fork and len(forks) < keep:
                forks.append(r)
            report(f"    {r.verdict}")
    ok = [x for x in results if "error" not in x]
    return SearchSummary(
        version=1, prompts=len(prompts), max_tokens=max_tokens, chat=chat,
        a=a.to_dict(), b=b.to_dict(),
        forked=sum(1 for x in ok if x["fork_index"] is not None),
        same_tokens_numbers_differ=sum(1 for x in ok if x["identical"]
                                       and not x["bit_identical"]),
        bit_identical=sum(1 for x in ok if x["bit_identical"]),
        errors=len(results) - len(ok),
        fork_indices=[x["fork_index"] for x in ok if x["fork_index"] is not None],
        tokens_compared=sum(x["tokens_compared"] for x in ok),
        close_calls=sum(x["close_calls"] for x in ok),
        smallest_margins=sorted(near, key=lambda m: m["margin"])[:10],
        results=results, forks=forks,
        elapsed_s=round(time.perf_counter() - t0, 3), backend=backend())


def _result(n: int, prompt: str, r: DivergenceRecord) -> dict:
    """One prompt's row of the search."""
    fork, logits, kv = r.fork, r.logits, r.kv
    m = logits.min_margin
    # A close call: the top-2 margin within 10x the logit noise between the sides.
    close = sum(1 for p in logits.per_token if p.max_abs_delta > 0
                and min(p.margin_a, p.margin_b) <= 10 * p.max_abs_delta)
    return {
        "index": n, "prompt": prompt, "identical": r.identical,
        "bit_identical": r.bit_identical,
        "fork_index": fork.token_index if fork else None,
        "fork_margin_a": fork.margin_a if fork else None,
        "fork_margin_b": fork.margin_b if fork else None,
        "min_margin": m.to_dict() if m else None, "max_abs_dlogit": logits.max_abs_delta,
        "tokens_compared": logits.compared_tokens, "close_calls": close,
        "first_logit_difference": logits.first_difference,
        "kv_first_difference": (kv.first_difference.position
                                if kv.first_difference else None),
        "max_abs_dkv": kv.max_abs_delta, "verdict": r.verdict}
