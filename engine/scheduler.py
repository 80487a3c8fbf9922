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

from engine.block_manager import BlockManager
from engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledGroup:
    seq: Sequence
    start: int  # first position computed this step
    num_rows: int
    phase: str  # "prefill", "decode" or "verify"
    drafts: list[int] = field(default_factory=list)  # verify: the proposed tokens

    @property
    def sample(self) -> bool:
        return self.phase == "verify" or self.start + self.num_rows == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens at the group's rows: the sequence's own, then any drafts."""
        own = self.seq.token_ids[self.start:self.start + self.num_rows - len(self.drafts)]
        return own + self.drafts


@dataclass
class SchedulerOutput:
    groups: list[ScheduledGroup] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
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
                group = ScheduledGroup(seq, seq.num_computed, rows,
                                       "decode" if decode_pass else "prefill")
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
            seq.num_computed = self.bm.match_prefix(seq.seq_id, seq.token_ids)
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
            out.groups.append(ScheduledGroup(seq, seq.num_computed, rows, "prefill"))
            scheduled.add(seq.seq_id)
            budget -= rows
        return out

    def _add_drafts(self, group: ScheduledGroup, proposed: list[int], budget: int) -> None:
        """Turn a decode group into a verify group with as many drafts as the budget and the
        free blocks allow (no preemption for a draft)."""
        seq = group.seq
        k = min(len(proposed), budget - group.num_rows)
        while k > 0:
            needed = self.bm.blocks_needed(seq.seq_id, seq.num_computed + 1 + k)
            if self.bm.can_allocate(needed):
                break
            k -= 1
        if k <= 0:
            return
        self.bm.allocate(seq.seq_id, seq.num_computed + 1 + k)
        group.drafts = list(proposed[:k])
        group.num_rows = 1 + k
        group.phase = "verify"

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
        self.bm.free(seq.seq_id)
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
            self.bm.free(seq.seq_id)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = reason

    def find(self, seq_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.seq_id == seq_id:
                return seq
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                return seq
        return None
