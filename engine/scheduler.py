"""Iteration-level scheduling: every step decides which sequences run and with how many rows.

Order inside a step: decode rows of running sequences first (so running streams never stall
behind a long prompt), then the next chunks of prompts already being prefilled, then new
requests from the waiting queue, all within `max_num_seqs` and the step's token budget
`max_num_batched_tokens`. When the KV pool runs out of blocks the newest running sequence is
preempted by recompute: its blocks are freed and it goes back to the head of the queue.

A decode row may carry drafted tokens (engine/speculative.py): the group becomes a "verify"
group of 1 + k rows. Drafts are cut to the budget left and to the blocks free without
preempting anyone: speculation never costs another request its place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.config import ValueEnum
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, LogitsProcessor, SeqStatus, Sequence
from engine.state_slots import StateSlots

if TYPE_CHECKING:
    from engine.model_runner import StepOutput
    from engine.sampler import Sample


class Phase(ValueEnum):
    PREFILL = "prefill"  # rows of a prompt (or of a preempted request's tokens)
    DECODE = "decode"  # the one row of the last sampled token
    VERIFY = "verify"  # that row and drafted tokens after it (engine/speculative.py)


@dataclass(eq=False)  # a group is itself: its sequence is compared by identity
class RowGroup:
    """The rows one sequence contributes to a step: what the scheduler plans, the runner
    computes (engine/model_runner.py) and `Scheduler.update_from_output` books. Tests and
    benchmarks build groups by hand from the first five fields."""

    seq_id: str
    token_ids: list[int]  # the tokens at positions [start, start + len)
    start: int  # position of the first row
    block_table: list[int]
    sample: bool  # the group ends at the sequence's last token: sample the next one
    params: SamplingParams | None = None
    output_index: int = 0  # index of the token to be sampled (seeds the per-request RNG)
    trace: bool = False  # return this group's written KV rows and its logits (divergence view)
    # VERIFY: token_ids[1:] are drafted tokens to verify: every row is sampled and the longest
    # agreeing prefix is kept. (The runner tells only verify groups from the others.)
    phase: Phase = Phase.PREFILL
    seq: Sequence | None = None  # the scheduled sequence (None: a group built by hand)
    # Models with recurrent layers (engine/state_slots.py): the sequence's live state slot; a
    # checkpoint slot to resume from before the step (None: from its slot, or from zero when
    # start is 0); (row, slot) snapshots of the state after a row (a verify group's rows but
    # the last, in scratch slots); and the (position, slot) of those that are checkpoints.
    state_slot: int | None = None
    restore_from: int | None = None
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, seq: Sequence, rows: int, phase: Phase, block_table: list[int]) -> RowGroup:
        """The next `rows` uncomputed tokens of a scheduled sequence."""
        start = seq.num_computed
        return cls(seq.seq_id, seq.tokens(start, start + rows), start, block_table,
                   start + rows == seq.num_tokens, seq.params, len(seq.output_ids),
                   phase=phase, seq=seq)

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)

    @property
    def verify(self) -> bool:
        return self.phase == Phase.VERIFY

    @property
    def drafts(self) -> list[int]:
        """A verify group's drafted tokens (none otherwise)."""
        return self.token_ids[1:] if self.verify else []

    @property
    def sampled_rows(self) -> int:
        """Rows whose logits the step needs: all of a verify group's, else the last one."""
        return self.num_rows if self.verify else int(self.sample)

    @property
    def logits_processors(self) -> tuple[LogitsProcessor, ...]:
        """The sequence's (engine/sampler.py); a group built by hand has none."""
        return self.seq.logits_processors if self.seq is not None else ()

    def tokens_through(self, row: int) -> list[int]:
        """The sequence's tokens up to and including the group's row `row`: what a logits
        processor sees for the token that row predicts."""
        return self.seq.token_ids[:self.start] + self.token_ids[:row + 1]


@dataclass
class GroupUpdate:
    """A scheduled group after its step: what it emits and what its sequence keeps."""

    group: RowGroup
    samples: list[Sample]  # accepted drafts, then the target's own token (none: not sampled)
    accepted: int  # drafts the target accepted
    kept: int  # rows whose keys and values the sequence keeps


@dataclass
class SchedulerOutput:
    groups: list[RowGroup] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    step: int = 0  # the number of the step that runs it (set by the engine at launch)

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 states: StateSlots | None = None):
        """states: the state slots of a model with recurrent layers (None: it has none)."""
        self.bm = block_manager
        self.states = states
        if states is not None and states.checkpoints:
            block_manager.on_evict = states.drop
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """drafts: seq_id -> proposed tokens for running sequences in decode (speculation)."""
        drafts = drafts or {}
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. Decode rows, oldest first. 2. Continue prefills of admitted sequences.
        for decode_pass in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.seq_id in scheduled or seq.status is not SeqStatus.RUNNING:
                    continue
                if seq.in_decode != decode_pass:
                    continue
                rows = 1 if decode_pass else min(seq.num_uncomputed, budget)
                if not self._reserve(seq, rows, scheduled, out):
                    continue  # seq itself was preempted
                group = RowGroup.of(seq, rows, Phase.DECODE if decode_pass else Phase.PREFILL,
                                    self.bm.block_table(seq.seq_id))
                if decode_pass and drafts.get(seq.seq_id):
                    self._add_drafts(group, drafts[seq.seq_id], budget)
                out.groups.append(group)
                scheduled.add(seq.seq_id)
                budget -= group.num_rows

        # 3. Admit waiting sequences while there is room (not in a step that had to preempt:
        # the preempted would only take back the blocks just freed).
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted):
            seq = self.waiting[0]
            if self.states is not None and not self.states.can_admit():
                break  # every state slot is held: wait for one
            seq.num_computed = self.bm.match_prefix(seq.seq_id, seq.token_ids)
            restore = self._resume_point(seq) if self.states is not None else None
            rows = min(seq.num_uncomputed, budget)
            if not self.bm.can_allocate(self.bm.blocks_needed(seq.seq_id, seq.num_computed + rows)):
                self.bm.free(seq.seq_id)  # give back the prefix blocks; retry next step
                seq.num_computed = 0
                break
            self.bm.allocate(seq.seq_id, seq.num_computed + rows)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_prompt = min(seq.num_computed, len(seq.prompt_ids))
            self.running.append(seq)
            out.groups.append(RowGroup.of(seq, rows, Phase.PREFILL,
                                          self.bm.block_table(seq.seq_id)))
            if self.states is not None:
                self.states.allocate(seq.seq_id)
                if restore is not None:
                    self.states.restore(seq.seq_id, restore)
                    out.groups[-1].restore_from = restore
            scheduled.add(seq.seq_id)
            budget -= rows
        if self.states is not None:
            for g in out.groups:
                self._plan_states(g)
        return out

    def _resume_point(self, seq: Sequence) -> int | None:
        """A model with recurrent layers resumes a cached prefix only where a state checkpoint
        was kept: cut the match back to the deepest block that has one. Returns the
        checkpoint's slot (None: from zero, the match given back)."""
        bs = self.bm.block_size
        for n in range(seq.num_computed // bs, 0, -1):
            slot = self.states.checkpoint(self.bm.block_hash(seq.seq_id, n - 1))
            if slot is not None:
                break
        else:
            n, slot = 0, None
        self.bm.keep_prefix(seq.seq_id, n)
        seq.num_computed = n * bs
        return slot

    def _plan_states(self, g: RowGroup) -> None:
        """A group's state slot, and the snapshots its step takes: a verify group's state after
        each row but the last (scratch, for whichever prefix is accepted), a prefill group's
        at each checkpoint position it passes (a verify group's were taken with its drafts)."""
        states = self.states
        g.state_slot = states.slot_of(g.seq_id)
        interval = states.interval if self.bm.enable_prefix_caching else 0
        if g.phase != Phase.PREFILL or not interval:
            return
        for position in range(-(-(g.start + 1) // interval) * interval, g.start + g.num_rows + 1,
                              interval):
            slot = states.reserve_checkpoint(g.seq_id)
            if slot is None:
                return
            g.snapshots.append((position - g.start - 1, slot))
            g.checkpoints.append((position, slot))

    def _add_drafts(self, group: RowGroup, proposed: list[int], budget: int) -> None:
        """Turn a decode group into a verify group with as many drafts as the budget and the
        free blocks allow (no preemption for a draft)."""
        seq = group.seq
        k = min(len(proposed), budget - group.num_rows)
        if self.states is not None:  # a scratch slot per draft (engine/state_slots.py)
            k = min(k, self.states.free_scratch)
        while k > 0:
            needed = self.bm.blocks_needed(seq.seq_id, seq.num_computed + 1 + k)
            if self.bm.can_allocate(needed):
                break
            k -= 1
        if k <= 0:
            return
        self.bm.allocate(seq.seq_id, seq.num_computed + 1 + k)
        if self.states is not None:  # the state after each row but the last
            group.snapshots = list(enumerate(self.states.take_scratch(seq.seq_id, k)))
        group.token_ids = group.token_ids + list(proposed[:k])
        group.block_table = self.bm.block_table(seq.seq_id)
        group.phase = Phase.VERIFY
        group.sample = True

    def _reserve(self, seq: Sequence, rows: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Make room for `rows` more tokens of `seq`, preempting newer sequences if needed."""
        while True:
            needed = self.bm.blocks_needed(seq.seq_id, seq.num_computed + rows)
            if self.bm.can_allocate(needed):
                self.bm.allocate(seq.seq_id, seq.num_computed + rows)
                return True
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None:  # cannot happen: seq itself is unscheduled
                raise RuntimeError("no sequence left to preempt")
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self.bm.register_tail(seq.seq_id, seq.token_ids, seq.num_computed)
        self.bm.free(seq.seq_id)
        if self.states is not None:
            self.states.free(seq.seq_id)
        self.running.remove(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks (always, whatever the reason)."""
        try:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
        finally:
            if reason != FinishReason.ERROR:  # a failed step may have left its rows unwritten
                self.bm.register_tail(seq.seq_id, seq.token_ids, seq.num_computed)
            self.bm.free(seq.seq_id)
            if self.states is not None:
                self.states.free(seq.seq_id)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = reason

    def update_from_output(self, plan: SchedulerOutput,
                           output: StepOutput) -> list[GroupUpdate]:
        """Book a step the model ran: each group's sequence keeps the keys and values of the
        rows it computed (a verify group: its last token's and the accepted drafts'; the
        rejected rows' blocks go back now, their slots are rewritten before being read) and
        registers its full blocks for the prefix cache. One update per group, in order."""
        updates = []
        for g in plan.groups:
            seq = g.seq
            sampled = output.sampled.get(g.seq_id)
            update = (GroupUpdate(g, [], 0, g.num_rows) if sampled is None else
                      GroupUpdate(g, sampled.samples, sampled.accepted,
                                  g.num_rows - len(g.drafts) + sampled.accepted))
            seq.num_computed += update.kept
            if g.verify:
                self.bm.trim(seq.seq_id, seq.num_computed + 1)
            kept_drafts = g.drafts[:update.accepted]
            self.bm.register_full_blocks(
                seq.seq_id, lambda seq=seq, drafts=kept_drafts: seq.token_ids + drafts,
                seq.num_computed)
            if self.states is not None:
                self._book_states(g, seq, update.accepted)
            updates.append(update)
        return updates

    def _book_states(self, g: RowGroup, seq: Sequence, accepted: int) -> None:
        """A verify group goes on from the state after its last accepted row; snapshots at
        checkpoint positions are kept as checkpoints of the blocks that end there; the step's
        other slots go back."""
        if g.verify and accepted < len(g.drafts):
            self.states.adopt(seq.seq_id, dict(g.snapshots)[accepted])
        bs = self.bm.block_size
        for position, slot in g.checkpoints:
            block_hash = self.bm.block_hash(seq.seq_id, position // bs - 1)
            if block_hash is not None and position <= seq.num_computed:
                self.states.commit_checkpoint(seq.seq_id, block_hash, slot)
        self.states.end_step(seq.seq_id)
