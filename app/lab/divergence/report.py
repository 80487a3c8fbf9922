"""The prose of a divergence record, shared by the command (app/cli/diverge.py, through
text.py) and the page (app/web/pages/divergence.py): the verdict, the cause-to-fork chain, the
contamination timeline merged for reading, and what the page shows of a record."""

from __future__ import annotations

from dataclasses import dataclass

from app.lab.divergence.record import (
    DivergenceRecord,
    RecordPart,
    StateComparison,
    TimelineRow,
    Writer,
)


def verdict(r: DivergenceRecord) -> str:
    logits, kv, state = r.logits, r.kv, r.state
    if r.bit_identical:
        states = ("" if state is None else
                  f" and max |Δstate| = 0 over {state.compared_steps} steps")
        return (f"bit-identical: the same {len(r.sides.a.token_ids)} tokens; "
                f"max |Δlogit| = 0 over {logits.compared_tokens} tokens and max |ΔKV| = 0 "
                f"over {kv.compared_positions} positions{states}")
    if r.identical:
        states = "" if state is None else f", max |Δstate| = {state.max_abs_delta:.3g}"
        return (f"same tokens, different numbers: max |Δlogit| = {logits.max_abs_delta:.3g}, "
                f"max |ΔKV| = {kv.max_abs_delta:.3g}{states}")
    f = r.fork
    return f"forked at output token {f.token_index} (character {f.char_offset})"


def chain(r: DivergenceRecord) -> list[str]:
    """Cause to effect, one sentence each: KV -> the recurrent state (models with recurrent
    layers) -> logits -> fork."""
    out = []
    kv, logits, fork = r.kv, r.logits, r.fork
    first = kv.first_difference
    if first is None:
        out.append(f"KV identical at all {kv.compared_positions} compared positions "
                   "(max |ΔKV| = 0)")
    else:
        where = ("prompt token" if first.in_prompt
                 else f"output token #{first.output_index} fed back")
        out.append(f"KV first differs at position {first.position} ({where}), written at "
                   f"{describe_writer(first.a)} on A vs {describe_writer(first.b)} on B; "
                   f"max |ΔKV| there {first.max_abs_delta:.3g}")
    if r.state is not None:
        out.append(_state_sentence(r.state))
    i = logits.first_difference
    if i is None:
        out.append(f"logits identical at all {logits.compared_tokens} compared tokens "
                   "(max |Δlogit| = 0)")
    else:
        p = logits.per_token[i]
        out.append(f"first logit difference at output token {i} (max |Δlogit| "
                   f"{p.max_abs_delta:.3g}; step {p.step_a} {p.path_a} {p.rows_a} "
                   f"rows on A, step {p.step_b} {p.path_b} {p.rows_b} rows on B)")
    if fork is None:
        m = logits.min_margin
        tail = (f"; smallest top-2 margin {m.value:.4g} at token {m.index} (side "
                f"{m.side.upper()})" if m else "")
        out.append(f"no fork in {len(r.sides.a.token_ids)} tokens{tail}")
    else:
        margins = ""
        if fork.margin_a is not None:
            margins = f" (top-2 margin A {fork.margin_a:.4g}, B {fork.margin_b:.4g})"
        out.append(f"fork at output token {fork.token_index}: A chose "
                   f"{fork.token_a} {fork.text_a!r}, B chose {fork.token_b} "
                   f"{fork.text_b!r}{margins}")
    return out


def _state_sentence(state: StateComparison) -> str:
    if state.first_difference is None:
        return (f"recurrent state identical after all {state.compared_steps} compared steps "
                "(max |Δstate| = 0)")
    p = next(p for p in state.per_step if p.tokens == state.first_difference)
    return (f"recurrent state first differs after {p.tokens} tokens (step {p.step_a} "
            f"{p.path_a} {p.rows_a} rows on A, step {p.step_b} {p.path_b} {p.rows_b} rows on "
            f"B); max |Δstate| there {p.max_abs_delta:.3g}, carried into every later state")


def describe_writer(w: Writer | None) -> str:
    """The step that wrote a position, in a sentence."""
    if w is None:
        return "—"
    return f"step {w.step} ({w.path}, {w.step_rows} rows)"


def describe_positions(first: int, last: int, prompt_tokens: int, *, short: bool = False) -> str:
    """What positions first..last hold: prompt tokens and/or output tokens fed back. short: the
    terminal's narrow column ("out #0–#10"); else the page's ("prompt + output #0–#3")."""
    if last < prompt_tokens:
        return "prompt"
    if short:
        def one(p: int) -> str:
            return "prompt" if p < prompt_tokens else f"out #{p - prompt_tokens}"

        return one(first) if first == last else \
            f"{one(first)}–{one(last).removeprefix('out ')}"
    lo = max(first, prompt_tokens) - prompt_tokens
    hi = last - prompt_tokens
    fed = f"output #{lo}" if lo == hi else f"output #{lo}–#{hi}"
    return ("prompt + " if first < prompt_tokens else "") + fed


def timeline(record: DivergenceRecord) -> list[TimelineRow]:
    """The contamination segments, with runs of one-position decode steps that look alike on
    both sides (same paths and row counts) merged into one row, for printing."""
    rows: list[TimelineRow] = []
    looks: list[tuple] = []
    singles: list[bool] = []
    for seg in record.kv.segments:
        a, b = seg.a, seg.b
        look = (a and (a.path, a.step_rows, a.rows), b and (b.path, b.step_rows, b.rows))
        single = seg.first == seg.last
        if rows and single and singles[-1] and looks[-1] == look:
            prev = rows[-1]
            prev.last = seg.last
            prev.steps_a[1] = a.step if a else None
            prev.steps_b[1] = b.step if b else None
            prev.count += 1
            prev.max_abs_delta = max(prev.max_abs_delta, seg.max_abs_delta)
            if prev.first_difference is None:
                prev.first_difference = seg.first_difference
            continue
        rows.append(TimelineRow(first=seg.first, last=seg.last, a=a, b=b,
                                max_abs_delta=seg.max_abs_delta,
                                first_difference=seg.first_difference,
                                steps_a=[a.step if a else None] * 2,
                                steps_b=[b.step if b else None] * 2))
        looks.append(look)
        singles.append(single)
    return rows


def holds_first_difference(record: DivergenceRecord, row: TimelineRow) -> bool:
    first = record.kv.first_difference
    return bool(first and row.first <= first.position <= row.last)


# ---- what the page shows of a record -------------------------------------------------------
@dataclass(kw_only=True)
class SideText(RecordPart):
    shared: str  # the text both sides produced (all of it, without a fork)
    rest: str  # this side's continuation after the fork


@dataclass(kw_only=True)
class ViewRow(TimelineRow):
    has_first: bool
    what: str


@dataclass(kw_only=True)
class ResultView(RecordPart):
    texts: dict[str, SideText]
    timeline: list[ViewRow]
    fork_token: int | None

    def to_dict(self) -> dict:
        return {"texts": {s: t.to_dict() for s, t in self.texts.items()},
                "timeline": [row.to_dict() for row in self.timeline],
                "fork_token": self.fork_token}


def result_view(record: DivergenceRecord) -> ResultView:
    """What the page shows of a finished record (the record itself goes to the JSON twin)."""
    fork = record.fork
    texts = {}
    for s, side in record.sides.items():
        if fork is None:
            texts[s] = SideText(shared=side.text, rest="")
        else:
            texts[s] = SideText(shared=fork.shared_text,
                                rest=getattr(fork, f"continuation_{s}"))
    rows = [ViewRow(**vars(row), has_first=holds_first_difference(record, row),
                    what=describe_positions(row.first, row.last, record.prompt_tokens))
            for row in timeline(record)]
    return ResultView(texts=texts, timeline=rows,
                      fork_token=fork.token_index if fork else None)
