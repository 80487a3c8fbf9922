"""The comparison of two runs of one prompt: tokens (where they fork), logits token by token
while both sides saw the same tokens, keys/values position by position, each position with
the step that wrote it on each side, and for models with recurrent layers the recurrent state
after each step both sides ended at the same token. The result is a DivergenceRecord (no
arrays in it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from app.lab.divergence.record import (
    DivergenceRecord,
    Fork,
    ForkRow,
    KvComparison,
    KvFirstDifference,
    LogitComparison,
    MinMargin,
    Segment,
    SideRecord,
    Sides,
    Speculation,
    StateComparison,
    StateStep,
    TokenLogits,
    Writer,
)
from app.lab.divergence.report import chain, verdict
from app.lab.divergence.sides import SideConfig
from engine.events import FinishEvent
from engine.speculative import common_prefix

Decode = Callable[[list[int]], str]


@dataclass
class SideRun:
    side: SideConfig
    prompt_ids: list[int]
    finish: FinishEvent
    trace: list[dict]
    steps: list[dict]  # every step from the target's first to its last (relative numbering)
    others_joined: bool
    model: str
    weights: str  # as loaded ("auto" resolved)
    eos_ids: set[int] = field(default_factory=set)
    tokens: list[dict] = field(default_factory=list)  # the target's token events (runs database)
    # Every step the side's engine ran for this run, as StepRecord.to_dict() with the step
    # renumbered like `steps` (engine_step: the engine's own number): the runs database's steps.
    engine_steps: list[dict] = field(default_factory=list)
    request_ids: dict = field(default_factory=dict)  # {"target": id, "alongside": [ids]}
    engine_config: dict = field(default_factory=dict)  # the engine as it ran this side


def compare(a: SideRun, b: SideRun, decode: Decode, top_k: int = 5) -> DivergenceRecord:
    """The divergence record of two runs of the same prompt."""
    chosen_a, chosen_b = _chosen(a), _chosen(b)
    fork = _fork_index(chosen_a, chosen_b)
    identical = fork is None and a.finish.token_ids == b.finish.token_ids
    logits_a, logits_b = _token_logits(a), _token_logits(b)
    logits = _compare_logits(logits_a, logits_b, fork)
    kv, any_kv_delta = _compare_kv(a, b, chosen_a, fork)
    state = _compare_state(a, b, fork)
    record = DivergenceRecord(
        version=1, model=a.model, prompt_ids=list(a.prompt_ids),
        prompt_tokens=len(a.prompt_ids),
        sides=Sides(a=_side(a, chosen_a), b=_side(b, chosen_b)),
        identical=identical,
        bit_identical=(identical and logits.max_abs_delta == 0.0 and not any_kv_delta
                       and (state is None or state.max_abs_delta == 0.0)),
        fork=None if fork is None else _fork(a, b, chosen_a, chosen_b, fork, logits,
                                             logits_a, logits_b, top_k, decode),
        logits=logits, kv=kv, state=state)
    record.verdict = verdict(record)
    record.chain = chain(record)
    return record


def _fork_index(chosen_a: list[int], chosen_b: list[int]) -> int | None:
    fork = next((i for i, (x, y) in enumerate(zip(chosen_a, chosen_b, strict=False))
                 if x != y), None)
    if fork is None and len(chosen_a) != len(chosen_b):
        fork = min(len(chosen_a), len(chosen_b))  # one side stopped earlier
    return fork


# ---- logits --------------------------------------------------------------------------------
def _token_logits(run: SideRun) -> list[tuple[np.ndarray, dict]]:
    """(logits, trace entry) for every token the target emitted, in order: one per sampled
    step, or one per emitted token of a verify step."""
    out = []
    for t in run.trace:
        logits = t["logits"]
        if logits is None:
            continue
        out.extend((row, t) for row in (logits if logits.ndim == 2 else [logits]))
    return out


def _chosen(run: SideRun) -> list[int]:
    """The token chosen at each sampled step: the output, plus a final EOS if it stopped on one."""
    ids = list(run.finish.token_ids)
    sampled = _token_logits(run)
    if len(sampled) > len(ids):
        ids.append(int(np.argmax(sampled[len(ids)][0])))
    return ids


def _margin(logits: np.ndarray) -> tuple[float, int, float]:
    """(top-1 minus top-2 logit, top-1 id, top-1 logit)."""
    top2 = np.argpartition(-logits, 1)[:2]
    first, second = sorted(top2, key=lambda i: -logits[i])
    return float(logits[first] - logits[second]), int(first), float(logits[first])


def _compare_logits(logits_a: list, logits_b: list, fork: int | None) -> LogitComparison:
    """Logits, token by token, while both sides saw the same tokens (the fork's included)."""
    n_logits = min(len(logits_a), len(logits_b))
    if fork is not None:
        n_logits = min(n_logits, fork + 1)
    per_token = []
    for i in range(n_logits):
        (la, ta), (lb, tb) = logits_a[i], logits_b[i]
        margin_a, top_a, top_logit_a = _margin(la)
        margin_b, top_b, top_logit_b = _margin(lb)
        per_token.append(TokenLogits(
            index=i, max_abs_delta=float(np.max(np.abs(la - lb))),
            margin_a=margin_a, margin_b=margin_b, top1_a=top_a, top1_b=top_b,
            top1_logit_a=top_logit_a, top1_logit_b=top_logit_b,
            step_a=ta["step"], step_b=tb["step"], path_a=ta["path"],
            path_b=tb["path"], rows_a=ta["step_rows"], rows_b=tb["step_rows"]))
    candidates = [MinMargin(index=p.index, side=s, value=getattr(p, f"margin_{s}"))
                  for p in per_token for s in ("a", "b")]
    return LogitComparison(
        compared_tokens=n_logits,
        max_abs_delta=max((p.max_abs_delta for p in per_token), default=0.0),
        first_difference=next((p.index for p in per_token if p.max_abs_delta > 0), None),
        min_margin=min(candidates, key=lambda m: m.value, default=None),
        per_token=per_token)


# ---- keys and values -----------------------------------------------------------------------
def _positions(run: SideRun) -> tuple[np.ndarray, list[int], int]:
    """Keys and values by position (last write wins), the trace entry that wrote each, and how
    many positions were written more than once (a preempted request recomputes its prefix)."""
    total = max(t["start"] + t["rows"] for t in run.trace)
    layers, two, heads, _, dim = run.trace[0]["kv"].shape
    kv = np.zeros((total, layers, two, heads, dim), dtype=np.float32)
    writer = [-1] * total
    rewrites = 0
    for i, t in enumerate(run.trace):
        lo, hi = t["start"], t["start"] + t["rows"]
        kv[lo:hi] = np.transpose(t["kv"], (3, 0, 1, 2, 4))
        rewrites += sum(1 for p in range(lo, hi) if writer[p] != -1)
        writer[lo:hi] = [i] * (hi - lo)
    return kv, writer, rewrites


def _writer(run: SideRun, index: int) -> Writer | None:
    if index < 0:
        return None
    t = run.trace[index]
    step = next((s for s in run.steps if s["step"] == t["step"]), {})
    return Writer(step=t["step"], path=t["path"], step_rows=t["step_rows"], phase=t["phase"],
                  start=t["start"], rows=t["rows"], prefill_rows=step.get("prefill_rows"),
                  decode_rows=step.get("decode_rows"), requests=step.get("requests"))


def _compare_kv(a: SideRun, b: SideRun, chosen_a: list[int],
                fork: int | None) -> tuple[KvComparison, bool]:
    """Keys and values, position by position, over the positions holding the same tokens; and
    whether any of them differs."""
    prompt_len = len(a.prompt_ids)
    kv_a, writer_a, rewrites_a = _positions(a)
    kv_b, writer_b, rewrites_b = _positions(b)
    n_pos = min(len(writer_a), len(writer_b))
    if fork is not None:
        n_pos = min(n_pos, prompt_len + fork)  # position prompt+fork holds the differing token
    delta = np.abs(kv_a[:n_pos] - kv_b[:n_pos])
    by_position = delta.reshape(n_pos, -1).max(axis=1) if n_pos else np.zeros(0)
    per_layer = delta.max(axis=(0, 2, 3, 4)) if n_pos else np.zeros(0)
    nonzero = np.flatnonzero(by_position > 0)
    first = None
    if nonzero.size:
        p = int(nonzero[0])
        d = delta[p]
        sequence = list(a.prompt_ids) + chosen_a
        first = KvFirstDifference(
            position=p, token_id=int(sequence[p]), in_prompt=p < prompt_len,
            output_index=None if p < prompt_len else p - prompt_len,
            a=_writer(a, writer_a[p]), b=_writer(b, writer_b[p]),
            max_abs_delta=float(by_position[p]),
            keys_max_abs_delta=float(d[:, 0].max()),
            values_max_abs_delta=float(d[:, 1].max()),
            max_abs_delta_per_layer=[float(x) for x in d.max(axis=(1, 2, 3))])
    kv = KvComparison(
        compared_positions=n_pos, max_abs_delta=float(by_position.max(initial=0)),
        max_abs_delta_per_layer=[float(x) for x in per_layer], first_difference=first,
        by_position=[float(x) for x in by_position],
        rewritten_positions={"a": rewrites_a, "b": rewrites_b},
        segments=_segments(a, b, writer_a, writer_b, by_position, n_pos))
    return kv, bool(nonzero.size)


def _segments(a: SideRun, b: SideRun, writer_a: list[int], writer_b: list[int],
              by_position: np.ndarray, n_pos: int) -> list[Segment]:
    """Runs of positions written by the same pair of steps (the contamination timeline)."""
    segments: list[Segment] = []
    keys: list[tuple[int, int]] = []
    for p in range(n_pos):
        key = (writer_a[p], writer_b[p])
        if keys and keys[-1] == key:
            seg = segments[-1]
            seg.last = p
        else:
            seg = Segment(first=p, last=p, a=_writer(a, writer_a[p]), b=_writer(b, writer_b[p]))
            segments.append(seg)
            keys.append(key)
        if by_position[p] > seg.max_abs_delta:
            seg.max_abs_delta = float(by_position[p])
        if by_position[p] > 0 and seg.first_difference is None:
            seg.first_difference = p
    return segments


# ---- the recurrent state (models with recurrent layers) ------------------------------------
def _states(run: SideRun) -> dict[int, int]:
    """Tokens consumed -> the trace entry whose state holds them (last write wins: a
    preempted request recomputes its prefix)."""
    return {t["start"] + t["rows"]: i for i, t in enumerate(run.trace) if "state" in t}


def _compare_state(a: SideRun, b: SideRun, fork: int | None) -> StateComparison | None:
    """The states after the same tokens on both sides, while they hold the same tokens; None
    when neither side's trace has states (a model without recurrent layers)."""
    ends_a, ends_b = _states(a), _states(b)
    if not ends_a and not ends_b:
        return None
    if not ends_a or not ends_b:
        side = "A" if not ends_a else "B"
        raise ValueError(f"side {side}'s trace has no recurrent state but the other's has: "
                         "the sides ran different models")
    limit = len(a.prompt_ids) + fork if fork is not None else None  # the differing token's
    per_step = []
    for end in sorted(ends_a.keys() & ends_b.keys()):
        if limit is not None and end > limit:
            break
        ta, tb = a.trace[ends_a[end]], b.trace[ends_b[end]]
        if ta["state"].shape != tb["state"].shape:
            raise ValueError(f"the recurrent states after {end} tokens differ in shape: "
                             f"{ta['state'].shape} on A, {tb['state'].shape} on B")
        delta = np.abs(ta["state"] - tb["state"]).reshape(len(ta["state"]), -1).max(axis=1)
        per_step.append(StateStep(
            tokens=end, step_a=ta["step"], step_b=tb["step"], path_a=ta["path"],
            path_b=tb["path"], rows_a=ta["step_rows"], rows_b=tb["step_rows"],
            max_abs_delta=float(delta.max(initial=0)),
            max_abs_delta_per_layer=[float(x) for x in delta]))
    per_layer = np.max([p.max_abs_delta_per_layer for p in per_step], axis=0) \
        if per_step else np.zeros(0)
    return StateComparison(
        compared_steps=len(per_step), max_abs_delta=float(per_layer.max(initial=0)),
        max_abs_delta_per_layer=[float(x) for x in per_layer],
        first_difference=next((p.tokens for p in per_step if p.max_abs_delta > 0), None),
        per_step=per_step)


# ---- the fork and the sides ----------------------------------------------------------------
def _fork(a: SideRun, b: SideRun, chosen_a: list[int], chosen_b: list[int], fork: int,
          logits: LogitComparison, logits_a: list, logits_b: list, top_k: int,
          decode: Decode) -> Fork:
    text_a, text_b = a.finish.text, b.finish.text
    char = common_prefix(text_a, text_b)
    out = Fork(
        token_index=fork, char_offset=char, shared_text=text_a[:char],
        continuation_a=text_a[char:], continuation_b=text_b[char:],
        token_a=chosen_a[fork] if fork < len(chosen_a) else None,
        token_b=chosen_b[fork] if fork < len(chosen_b) else None,
        text_a=decode([chosen_a[fork]]) if fork < len(chosen_a) else None,
        text_b=decode([chosen_b[fork]]) if fork < len(chosen_b) else None)
    if fork < logits.compared_tokens:
        p = logits.per_token[fork]
        out.margin_a, out.margin_b = p.margin_a, p.margin_b
        out.step_a, out.step_b = p.step_a, p.step_b
        out.table = _fork_table(logits_a[fork][0], logits_b[fork][0], top_k, decode)
    return out


def _fork_table(la: np.ndarray, lb: np.ndarray, top_k: int, decode: Decode) -> list[ForkRow]:
    """The leading tokens of both sides with their logits (the mini-vllm-rs write-up's table)
    and logprobs."""
    k = max(1, min(top_k, la.shape[0]))
    ids = list(dict.fromkeys([*np.argsort(-la, kind="stable")[:k].tolist(),
                              *np.argsort(-lb, kind="stable")[:k].tolist()]))
    lse_a = _logsumexp(la)
    lse_b = _logsumexp(lb)
    rows = []
    for t in ids:
        xa, xb = float(la[t]), float(lb[t])
        rows.append(ForkRow(token_id=int(t), text=decode([int(t)]), logit_a=xa, logit_b=xb,
                            delta=xb - xa, logprob_a=xa - lse_a, logprob_b=xb - lse_b,
                            rank_a=int((la > la[t]).sum()) + 1,
                            rank_b=int((lb > lb[t]).sum()) + 1))
    rows.sort(key=lambda r: (r.rank_a, r.rank_b))
    return rows


def _logsumexp(x: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    m = float(x64.max())
    return m + float(np.log(np.exp(x64 - m).sum()))


def _side(run: SideRun, chosen: list[int]) -> SideRecord:
    finish = run.finish
    return SideRecord(
        config=run.side.to_dict(), label=run.side.label(), model=run.model,
        weights=run.weights, token_ids=list(finish.token_ids), text=finish.text,
        finish_reason=finish.reason, chosen=chosen, others_joined=run.others_joined,
        steps=run.steps, tokens=run.tokens, preemptions=finish.preemptions,
        times={"queued": finish.arrival_time, "first_scheduled": finish.first_scheduled_time,
               "first_token": finish.first_token_time, "finished": finish.finish_time},
        engine_steps=run.engine_steps, request_ids=run.request_ids, engine=run.engine_config,
        speculation=_speculation(run))


def _speculation(run: SideRun) -> Speculation | None:
    """The target's drafts over the run: proposed, accepted, the rate (None: not speculating)."""
    if run.side.speculative == "off":
        return None
    drafted = sum(s.get("target_drafted", 0) for s in run.steps)
    accepted = sum(s.get("target_accepted", 0) for s in run.steps)
    return Speculation(
        method=run.side.speculative, k=run.side.num_speculative_tokens,
        draft_model=run.side.engine_draft_model,
        verify_steps=sum(1 for s in run.steps if s.get("target_phase") == "verify"),
        drafted=drafted, accepted=accepted, acceptance=accepted / drafted if drafted else None)
