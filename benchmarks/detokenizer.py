"""Per-token cost of turning sampled tokens into text: a full re-decode per token against the
incremental decode of engine.output.OutputText, at output lengths 100 to 4000 tokens.

One 4,000-token output (English prose, accented words, CJK and emoji, so characters split
across tokens) is streamed token by token through each way, on the embedded model's tokenizer,
with a stop string that never matches (so the held-back text is exercised too). The cost at
length n is the median time of adding the tokens n-49..n; each way streams --repeats times and
the table gives the median over the rounds.

    .venv/bin/python benchmarks/detokenizer.py [--tokens 4000] [--at 100 500 1000 2000 4000]
        [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine.model_loader import load_embedded_tokenizer
from engine.output import OutputText

TEXT = ("Continuous batching adds and removes requests at every step. Le café était plein, "
        "l'été à Ærøskøbing. 連続バッチ処理は各ステップで要求を追加します。 Done 🎉🚀 ok! "
        "Numbers: 12345, 67.89; code: def f(x): return x * 2\n")
STOP = ("<|never|>",)
WINDOW = 50


class FullRedecode:
    """The old OutputText.add: decode the whole output again for every token."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._released = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        self.token_ids.append(token_id)
        text = self._tokenizer.decode(self.token_ids).rstrip("\ufffd")
        stopped = False
        if self._stop:
            search_from = max(0, self._released - self._hold)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text, stopped = text[:min(hits)], True
        self.text = text
        upto = len(text) if stopped else len(text) - self._hold
        out = text[self._released:upto] if upto > self._released else ""
        self._released = max(self._released, upto)
        return out, stopped


def output_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT, add_special_tokens=False)
    return ids[:n]


def stream_times(make, ids: list[int]) -> tuple[list[int], str]:
    """Nanoseconds each add() took, and the text streamed."""
    out = make()
    times, pieces = [], []
    for token_id in ids:
        start = time.perf_counter_ns()
        delta, _ = out.add(token_id)
        times.append(time.perf_counter_ns() - start)
        pieces.append(delta)
    return times, "".join(pieces)


def measure(tokenizer, ids: list[int], at: list[int], repeats: int,
            log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    ways = {"full_redecode": lambda: FullRedecode(tokenizer, STOP),
            "incremental": lambda: OutputText(tokenizer, STOP)}
    per_round: dict[str, list[list[int]]] = {name: [] for name in ways}
    texts = {}
    for r in range(repeats):
        for name, make in ways.items():
            start = time.perf_counter()
            times, texts[name] = stream_times(make, ids)
            per_round[name].append(times)
            log(f"round {r + 1}/{repeats} {name}: {len(ids)} tokens in "
                f"{time.perf_counter() - start:.2f} s")
    if texts["incremental"] != texts["full_redecode"]:
        raise SystemExit("the two ways streamed different text")
    rows = []
    for n in at:
        row = {"tokens": n}
        for name, rounds in per_round.items():
            medians = [statistics.median(t[max(0, n - WINDOW):n]) for t in rounds]
            row[f"{name}_us"] = round(statistics.median(medians) / 1000, 2)
        row["speedup"] = round(row["full_redecode_us"] / row["incremental_us"], 1)
        rows.append(row)
    return rows


def render_table(rows: list[dict], repeats: int) -> str:
    head = (f"Per-token cost of OutputText.add on the embedded model's tokenizer (SmolLM2), one "
            f"stop string that never matches; the median of tokens n-{WINDOW - 1}..n, median "
            f"of {repeats} rounds. Before: the whole output decoded again each token; after: "
            "the incremental decode, which keeps as one string only the text a stop string may "
            "still claim, so no work grows with the output.\n\n"
            "| output length (tokens) | before: full re-decode (µs/token) "
            "| after: incremental (µs/token) | speedup |\n|---|---|---|---|")
    lines = [f"| {r['tokens']} | {r['full_redecode_us']:.1f} | {r['incremental_us']:.2f} "
             f"| {r['speedup']:.0f}x |" for r in rows]
    return "\n".join([head, *lines])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000, help="length of the streamed output")
    ap.add_argument("--at", type=int, nargs="+", default=[100, 500, 1000, 2000, 4000],
                    help="output lengths to report the per-token cost at")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/detokenizer.json")
    args = ap.parse_args()
    if max(args.at) > args.tokens:
        ap.error("--at lengths must not exceed --tokens")

    tokenizer = load_embedded_tokenizer()
    ids = output_ids(tokenizer, args.tokens)
    rows = measure(tokenizer, ids, args.at, args.repeats)
    table = render_table(rows, args.repeats)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tokenizer": "embedded SmolLM2", "stop": list(STOP),
                               "window": WINDOW, "repeats": args.repeats, "rows": rows},
                              indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"(written to {out} and {out.with_suffix('.md')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
