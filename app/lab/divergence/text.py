"""A divergence record, or a search over many prompts, as terminal text (batchscope diverge)."""

from __future__ import annotations

from app.lab.divergence.record import DivergenceRecord, SearchSummary, Writer
from app.lab.divergence.report import describe_positions, holds_first_difference, timeline
from engine.platform import blas_name


def clean(text: str | None) -> str:
    """Model output on a terminal: control characters (escape sequences) made visible."""
    if text is None:
        return ""
    return "".join(ch if ch in "\n\t" or (ord(ch) >= 32 and ord(ch) != 127)
                   else f"\\x{ord(ch):02x}" for ch in text)


def g(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{x:.{digits}g}")


def _writer_columns(w: Writer | None, steps: list | None = None) -> str:
    if w is None:
        return "—"
    first, last = steps or (w.step, w.step)
    step = str(first) if first == last else f"{first}–{last}"
    return f"{step:>7} {w.path:<6} {w.step_rows:>4}"


def _speculation_lines(r: DivergenceRecord) -> list[str]:
    out = []
    for name, side in r.sides.items():
        s = side.speculation
        if s:
            rate = "–" if s.acceptance is None else f"{100 * s.acceptance:.1f}%"
            by = f" from {s.draft_model}" if s.draft_model else ""
            out.append(f"{name.upper()} drafts{by}: {s.accepted} of {s.drafted} accepted "
                       f"({rate}) over {s.verify_steps} verify steps")
    return out


def format_record(r: DivergenceRecord, all_tokens: bool = False) -> str:
    a, b = r.sides.a, r.sides.b
    blas = blas_name((r.backend or {}).get("blas")) or "bundled"
    max_tokens = "?" if r.max_tokens is None else r.max_tokens
    out = [f"model {r.model} · prompt {r.prompt_tokens} tokens · "
           f"{max_tokens} new tokens · greedy · BLAS {blas}",
           f"A: {a.label}", f"B: {b.label}", *_speculation_lines(r), "",
           f"Verdict: {r.verdict}", "", "Cause → fork:"]
    out += [f"  {i + 1}. {line}" for i, line in enumerate(r.chain)]
    out += _fork_lines(r)
    out += _logit_lines(r, all_tokens)
    out += _timeline_lines(r)
    return "\n".join(out)


def _fork_lines(r: DivergenceRecord) -> list[str]:
    fork = r.fork
    if fork is None:
        return ["", "Text (both sides):", _indent(clean(r.sides.a.text))]
    out = ["", f"Shared text ({fork.char_offset} characters):",
           _indent(clean(fork.shared_text)),
           "A continues:", _indent(clean(fork.continuation_a)),
           "B continues:", _indent(clean(fork.continuation_b))]
    if fork.table:
        out += ["", f"Logits at the fork (output token {fork.token_index}; * = chosen):",
                f"  {'token':>7}  {'text':<16} {'A logit':>12} {'B logit':>12} "
                f"{'B − A':>10}  {'rank A':>6}  {'rank B':>6}"]
        for row in fork.table:
            mark_a = "*" if row.token_id == fork.token_a else " "
            mark_b = "*" if row.token_id == fork.token_b else " "
            out.append(f"  {row.token_id:>7}  {clean(repr(row.text)):<16.16} "
                       f"{row.logit_a:>12.6f} {row.logit_b:>12.6f} "
                       f"{row.delta:>+10.6f}  {row.rank_a:>5}{mark_a}  "
                       f"{row.rank_b:>5}{mark_b}")
        out.append(f"  top-2 margin: A {g(fork.margin_a, 4)}, B {g(fork.margin_b, 4)}")
    return out


def _logit_lines(r: DivergenceRecord, all_tokens: bool) -> list[str]:
    logits, fork = r.logits, r.fork
    out = ["", f"Logits token by token while the sides agree ({logits.compared_tokens} "
               "tokens):",
           f"  {'token':>5}  {'A step path rows':>19}  {'B step path rows':>19}  "
           f"{'max|Δlogit|':>11}  {'margin A':>9}  {'margin B':>9}"]
    rows = logits.per_token
    shown = _telling(r) if not all_tokens and len(rows) > 20 else set(range(len(rows)))
    previous = -1
    for p in rows:
        if p.index not in shown:
            continue
        if p.index != previous + 1:
            out.append("  …")
        previous = p.index
        flag = " ← fork" if fork and p.index == fork.token_index else ""
        out.append(f"  {p.index:>5}  {p.step_a:>7} {p.path_a:<6} {p.rows_a:>4}  "
                   f"{p.step_b:>7} {p.path_b:<6} {p.rows_b:>4}  "
                   f"{g(p.max_abs_delta):>11}  {g(p.margin_a, 4):>9}  "
                   f"{g(p.margin_b, 4):>9}{flag}")
    if previous != len(rows) - 1 and rows:
        out.append("  …")
    return out


def _timeline_lines(r: DivergenceRecord) -> list[str]:
    kv = r.kv
    out = ["", f"Contamination timeline: keys/values compared at {kv.compared_positions} "
               "positions (* = first difference)",
           f"  {'positions':>9}  {'what':<14} {'A step path rows':>19}  "
           f"{'B step path rows':>19}  {'max|ΔKV|':>9}"]
    for row in timeline(r):
        span = str(row.first) if row.first == row.last else f"{row.first}–{row.last}"
        star = " *" if holds_first_difference(r, row) else ""
        what = describe_positions(row.first, row.last, r.prompt_tokens, short=True)
        out.append(f"  {span:>9}  {what:<14.14} "
                   f"{_writer_columns(row.a, row.steps_a)}  "
                   f"{_writer_columns(row.b, row.steps_b)}  "
                   f"{g(row.max_abs_delta):>9}{star}")
    first = kv.first_difference
    if first:
        layers = first.max_abs_delta_per_layer
        out.append(f"  at position {first.position}: max |ΔK| {g(first.keys_max_abs_delta)}, "
                   f"max |ΔV| {g(first.values_max_abs_delta)}; per layer: "
                   + " ".join(g(x, 2) for x in layers))
    return out


def _telling(r: DivergenceRecord) -> set[int]:
    """Token rows worth printing: the first logit difference, the nearest ties, the last ones."""
    rows = r.logits.per_token
    keep = {0, len(rows) - 1}
    if r.logits.first_difference is not None:
        keep.add(r.logits.first_difference)
    nearest = sorted(rows, key=lambda p: min(p.margin_a, p.margin_b))[:3]
    keep.update(p.index for p in nearest)
    keep.update(range(max(0, len(rows) - 5), len(rows)))
    return keep


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text or "(empty)").split("\n"))


def format_search(s: SearchSummary, all_tokens: bool = False) -> str:
    out = [f"search: {s.prompts} prompts × {s.max_tokens} tokens",
           f"A: {s.a['label']}", f"B: {s.b['label']}", "",
           f"  {'#':>3}  {'fork at':>7}  {'margin A/B at fork':>19}  {'min margin (token)':>19}  "
           f"{'max|Δlogit|':>11}  {'KV first Δ':>10}  prompt"]
    for x in s.results:
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
    ok = s.prompts - s.errors
    indices = ", ".join(str(i) for i in s.fork_indices)
    out += ["", f"Forked: {s.forked} of {ok}" + (f" (at tokens {indices})" if indices else "")
            + f" · same tokens, numbers differ: {s.same_tokens_numbers_differ}"
            f" · bit-identical: {s.bit_identical}"
            + (f" · errors: {s.errors}" if s.errors else "")]
    out.append(f"Tokens compared: {s.tokens_compared}; close calls (top-2 margin within 10x "
               f"that token's max |Δlogit|): {s.close_calls}")
    if s.smallest_margins:
        out.append("Smallest top-2 margins seen: " + ", ".join(
            f"{m['margin']:.4g} (prompt {m['prompt_index'] + 1}, token {m['token_index']}"
            + (", forked" if m["forked_here"] else "") + ")" for m in s.smallest_margins[:5]))
    if s.forks:
        out += ["", "First fork in detail:", "", format_record(s.forks[0], all_tokens)]
    return "\n".join(out)
