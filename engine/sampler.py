"""From a step's logits to the tokens it emits: per-row logits processors, the log-softmax,
greedy or seeded sampling, and speculative acceptance of drafted tokens.

Same arithmetic as mlx-lm's generate: log-softmax in the model's dtype, then argmax (greedy)
or a categorical draw over the top-p / top-k cut scores at the request's temperature. A
verify group (engine/speculative.py) keeps the longest prefix of its drafts the target accepts
(greedy: the drafts it would have picked; sampling: speculative sampling) and then the target's
own next token; how many drafts that is is decided here, once (`Sampled.accepted`).

Logits processors follow mlx-lm's convention, `processor(tokens, logits) -> logits`: tokens
(n,) are the sequence up to and including the row's token, logits (1, vocab) the row's raw
logits; a request's processors apply in order before the log-softmax (penalties, grammar
masks, logit bias; Sequence.logits_processors). Steps without any keep the graph they had
without the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from engine.sampling import SamplingParams
from engine.scheduler import RowGroup
from engine.speculative import accepted_prefix

NEG_INF = float("-inf")


@dataclass
class Sample:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives
    drafted: bool = False  # a drafted token the target accepted


@dataclass
class Sampled:
    """What one sampled group emits: its accepted drafts, then the target's own next token."""

    samples: list[Sample]
    accepted: int = 0  # drafts the target accepted (a verify group's; 0 otherwise)


def sample(logits: mx.array, groups: list[RowGroup],
           logsumexp: Callable[[mx.array], mx.array], evaluate: list) -> dict[str, Sampled]:
    """logits: (sampled rows, vocab), each group's `sampled_rows` in order; logsumexp: (rows,
    vocab) -> (rows, 1); evaluate: arrays to evaluate with the samples (the pool's writes).
    Returns seq_id -> what the group emits."""
    return draw(logits, groups, logsumexp, evaluate).read()


@dataclass
class Draw:
    """A step's samples as arrays queued for evaluation (mx.async_eval): `token_ids` can feed
    the next step's graph before they are computed (engine/lookahead.py); read() waits."""

    groups: list[RowGroup]
    token_ids: mx.array  # (sampled rows,) each row's chosen token
    token_lp: mx.array
    draft_lp: mx.array
    checks: mx.array | None  # sampling verify rows: (p(draft), u) per draft
    top_ids: mx.array | None
    top_lp: mx.array | None

    def read(self) -> dict[str, Sampled]:
        """seq_id -> what the group emits (waits for the evaluation)."""
        groups = self.groups
        ids_list = self.token_ids.tolist()
        lp_list = self.token_lp.astype(mx.float32).tolist()
        draft_lp_list = self.draft_lp.astype(mx.float32).tolist()
        checks_list = (self.checks.astype(mx.float32).tolist() if self.checks is not None
                       else [])
        top_ids_l = self.top_ids.tolist() if self.top_ids is not None else None
        top_lp_l = self.top_lp.astype(mx.float32).tolist() if self.top_lp is not None else None

        def top(row: int, want: int) -> list[tuple[int, float]]:
            if not want:
                return []
            pairs = sorted(zip(top_ids_l[row], top_lp_l[row], strict=True),
                           key=lambda t: -t[1])
            return pairs[:want]

        out, at, check = {}, 0, 0
        for g in groups:
            want = g.params.logprobs if g.params else 0
            drafts = g.drafts
            if g.params is None or g.params.greedy:
                accepted = accepted_prefix(drafts, ids_list[at:at + len(drafts)])
            else:
                accepted = next((j for j, (prob, u) in
                                 enumerate(checks_list[check:check + len(drafts)])
                                 if u >= prob), len(drafts))
                check += len(drafts)
            emitted = [Sample(drafts[j], draft_lp_list[at + j], top(at + j, want), drafted=True)
                       for j in range(accepted)]
            last = at + accepted
            emitted.append(Sample(ids_list[last], lp_list[last], top(last, want)))
            out[g.seq_id] = Sampled(emitted, accepted)
            at += g.sampled_rows
        return out


def draw(logits: mx.array, groups: list[RowGroup],
         logsumexp: Callable[[mx.array], mx.array], evaluate: list,
         greedy_op: Callable[[mx.array], tuple[mx.array, mx.array] | None] | None = None
         ) -> Draw:
    """`sample`'s graph, queued for evaluation with `evaluate`, not waited for. greedy_op:
    where every row is greedy with no top logprobs and no drafts to check, (logits) -> (token
    ids, their logprobs) with this graph's bits in fewer ops, or None where it does not apply
    (NativeOps.greedy)."""
    logits = _processed(logits, groups)
    k = max((g.params.logprobs if g.params else 0) for g in groups)
    if greedy_op is not None and k == 0 and all(
            (g.params is None or g.params.greedy) and not g.verify for g in groups):
        found = greedy_op(logits)
        if found is not None:
            token_ids, token_lp = found
            mx.async_eval(token_ids, token_lp, *evaluate)
            return Draw(groups, token_ids, token_lp, token_lp, None, None, None)
    logprobs = logits - logsumexp(logits)
    greedy = mx.argmax(logprobs, axis=-1)
    # Per sampled row: the target's choice there. A sampling verify group also gets, per
    # draft, the target's probability of it and a uniform draw (speculative sampling).
    checks = []
    if all(g.params is None or g.params.greedy for g in groups):
        token_ids = greedy  # the usual step: no per-row graph at all
    else:
        chosen, at = [], 0
        for g in groups:
            p, n = g.params, g.sampled_rows
            if p is None or p.greedy:
                chosen.append(greedy[at:at + n])
            else:
                for j, d in enumerate(g.drafts):
                    accept_prob, u, residual = verify_row(logprobs[at + j], p,
                                                          g.output_index + j, d)
                    chosen.append(residual[None])
                    checks.append(mx.stack([accept_prob, u]))
                chosen.append(sample_row(logprobs[at + n - 1], p, g.output_index + n - 1)[None])
            at += n
        token_ids = mx.concatenate(chosen)
    token_lp = mx.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    draft_lp = token_lp
    if any(g.verify for g in groups):
        # Row j of a verify group emits draft j + 1 if it is accepted: its logprob there.
        drafts = []
        for g in groups:
            drafts += g.drafts
            drafts.append(0)  # the group's last row: never a draft's
        draft_lp = mx.take_along_axis(logprobs, mx.array(drafts)[:, None], axis=-1)[:, 0]
    checks = mx.stack(checks) if checks else None
    top_ids = top_lp = None
    wanted = [token_ids, token_lp, draft_lp, *evaluate]
    if k:
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
        wanted += [top_ids, top_lp]
    mx.async_eval(*wanted, *([checks] if checks is not None else []))
    return Draw(groups, token_ids, token_lp, draft_lp, checks, top_ids, top_lp)


def _processed(logits: mx.array, groups: list[RowGroup]) -> mx.array:
    """The logits with each group's processors applied to its rows (the others as they are,
    cut and joined: the same values); the input itself where no group has any."""
    if not any(g.logits_processors for g in groups):
        return logits
    rows, at = [], 0
    for g in groups:
        n, processors = g.sampled_rows, g.logits_processors
        if not processors:
            rows.append(logits[at:at + n])
        for j in range(n) if processors else ():
            # The group's row num_rows - n + j: its token is the last its processors see.
            tokens = mx.array(g.tokens_through(g.num_rows - n + j))
            row = logits[at + j][None]
            for processor in processors:
                row = processor(tokens, row)
            rows.append(row.astype(logits.dtype))  # in the model's dtype, as the others
        at += n
    return mx.concatenate(rows)


def target_scores(logprobs: mx.array, p: SamplingParams) -> mx.array:
    """(1, vocab) scores whose softmax is the distribution a request samples from: top-p,
    min-p and top-k cuts, then temperature."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    x = logprobs[None]
    if 0.0 < p.top_p < 1.0:
        x = apply_top_p(x, p.top_p)
    if p.min_p > 0.0:
        x = apply_min_p(x, p.min_p)
    if 0 < p.top_k < x.shape[-1]:
        x = apply_top_k(x, p.top_k)
    return x * (1.0 / p.temperature)


def row_key(p: SamplingParams, output_index: int) -> mx.array | None:
    """A key per (seed, token index): the same request samples the same tokens whatever
    shares its batch, and a preempted request resumes on the same random stream."""
    if p.seed is None:
        return None
    return mx.random.key((p.seed * 1_000_003 + output_index) % (2**63))


def sample_row(logprobs: mx.array, p: SamplingParams, output_index: int) -> mx.array:
    return mx.random.categorical(target_scores(logprobs, p), key=row_key(p, output_index))[0]


def verify_row(logprobs: mx.array, p: SamplingParams, output_index: int,
               draft: int) -> tuple[mx.array, mx.array, mx.array]:
    """Speculative sampling of one drafted token (a point proposal, as prompt lookup makes):
    accept it when u < p(draft), otherwise emit a sample of p with the draft taken out. Each
    emitted token is then distributed exactly as p (tests/engine/test_speculative.py).
    Returns (p(draft), u, the residual sample)."""
    scores = target_scores(logprobs, p)[0]
    probs = mx.softmax(scores, axis=-1)
    key = row_key(p, output_index)
    accept_key, residual_key = mx.random.split(key) if key is not None else (None, None)
    u = mx.random.uniform(key=accept_key)
    residual = mx.where(mx.arange(scores.shape[-1]) == draft, NEG_INF, scores)
    return probs[draft], u, mx.random.categorical(residual, key=residual_key)
