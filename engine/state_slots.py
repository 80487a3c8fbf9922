"""Recurrent-state bookkeeping: which slot of the state pool holds whose state.

Pure Python, no tensors (the arrays live in engine/state_pool.py), the counterpart of
block_manager.py for the layers that keep a recurrent state instead of keys and values
(Gated DeltaNet). The pool's slots come in three regions:

- live slots: one per running sequence, taken at admission and given back when it finishes,
  is cancelled, fails or is preempted, as its KV blocks are; a request waits when none is free;
- scratch slots: a verify group's state after each of its rows but the last, held for one
  step; the one after the accepted prefix becomes the sequence's live slot (the old live
  slot joins the scratch), so nothing is recomputed or copied. Live and scratch slots are
  alike: only their counts are fixed;
- checkpoints: a sequence's state at a block-aligned position (every `interval` tokens),
  keyed by the prefix-cache hash of the block that ends there. A later prompt with the same
  prefix resumes from the deepest one its cached blocks reach. Least recently used first out
  when the budget is full, and dropped when their block leaves the prefix cache. A checkpoint
  being restored in a step, or reserved for a snapshot, is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Holds:
    live: int
    step: list[int] = field(default_factory=list)  # scratch and reserved checkpoint slots
    pinned: list[int] = field(default_factory=list)  # checkpoints restored this step


class StateSlots:
    def __init__(self, live: int, scratch: int = 0, checkpoints: int = 0, *,
                 interval: int = 0, slot_bytes: int = 0):
        """live, scratch, checkpoints: slots of each region; interval: tokens between
        checkpoints (0: none); slot_bytes: one slot's bytes, for the step records."""
        if live < 1 or scratch < 0 or checkpoints < 0:
            raise ValueError("the state pool needs at least one live slot")
        self.live, self.scratch, self.checkpoints = live, scratch, checkpoints
        self.interval = interval if checkpoints else 0
        self.slot_bytes = slot_bytes
        self._free_live = list(range(live - 1, -1, -1))
        self._free_scratch = list(range(live + scratch - 1, live - 1, -1))
        self._free_ckpt = list(range(self.total - 1, live + scratch - 1, -1))
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self._pins: dict[int, int] = {}  # checkpoint slot -> restores in flight
        self._seqs: dict[str, _Holds] = {}
        self.hits = 0  # admissions that resumed from a checkpoint

    @property
    def total(self) -> int:
        return self.live + self.scratch + self.checkpoints

    # ---- live slots ------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self._free_live)

    def allocate(self, seq_id: str) -> int:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already holds a state slot")
        if not self._free_live:
            raise RuntimeError("no free state slot")
        self._seqs[seq_id] = _Holds(self._free_live.pop())
        return self._seqs[seq_id].live

    def slot_of(self, seq_id: str) -> int:
        return self._seqs[seq_id].live

    def free(self, seq_id: str) -> None:
        """Give back everything the sequence holds. Idempotent."""
        holds = self._seqs.pop(seq_id, None)
        if holds is None:
            return
        self._end_step(holds)
        self._free_live.append(holds.live)

    # ---- one step's slots ------------------------------------------------------------------
    @property
    def free_scratch(self) -> int:
        return len(self._free_scratch)

    def take_scratch(self, seq_id: str, n: int) -> list[int]:
        """Up to n scratch slots for the step (fewer when the region is short)."""
        taken = [self._free_scratch.pop() for _ in range(min(n, len(self._free_scratch)))]
        self._seqs[seq_id].step.extend(taken)
        return taken

    def adopt(self, seq_id: str, slot: int) -> None:
        """The sequence goes on from one of its step's slots (a verify group's state after its
        last accepted row): that slot becomes its live slot and the old one goes back with
        the step's. Nothing is copied."""
        holds = self._seqs[seq_id]
        holds.step[holds.step.index(slot)] = holds.live
        holds.live = slot

    def reserve_checkpoint(self, seq_id: str) -> int | None:
        """A checkpoint slot to snapshot into this step (the least recently used checkpoint
        not being restored is evicted for it), or None when every one is in use."""
        if not self._free_ckpt:
            victim = next((h for h, slot in self._by_hash.items() if slot not in self._pins),
                          None)
            if victim is None:
                return None
            self._free_ckpt.append(self._by_hash.pop(victim))
        slot = self._free_ckpt.pop()
        self._seqs[seq_id].step.append(slot)
        return slot

    def commit_checkpoint(self, seq_id: str, block_hash: int, slot: int) -> None:
        """Keep a reserved slot's snapshot as the checkpoint of this block hash (an equal one
        already kept: the slot goes back)."""
        self._seqs[seq_id].step.remove(slot)
        if block_hash in self._by_hash:
            self._free_ckpt.append(slot)
        else:
            self._by_hash[block_hash] = slot

    def checkpoint(self, block_hash: int) -> int | None:
        """The slot holding the state at the end of this block, or None."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def restore(self, seq_id: str, slot: int) -> None:
        """The sequence resumes from this checkpoint in its next step: pinned until then."""
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._seqs[seq_id].pinned.append(slot)
        self.hits += 1

    def end_step(self, seq_id: str) -> None:
        """The step is booked: scratch, uncommitted reservations and pins go back."""
        holds = self._seqs.get(seq_id)
        if holds is not None:
            self._end_step(holds)

    def _end_step(self, holds: _Holds) -> None:
        for slot in holds.step:
            (self._free_scratch if slot < self.live + self.scratch else
             self._free_ckpt).append(slot)
        for slot in holds.pinned:
            self._pins[slot] -= 1
            if not self._pins[slot]:
                del self._pins[slot]
        holds.step.clear()
        holds.pinned.clear()

    def drop(self, block_hash: int) -> None:
        """The block left the prefix cache: its checkpoint can never be reached again."""
        slot = self._by_hash.get(block_hash)
        if slot is not None and slot not in self._pins:
            del self._by_hash[block_hash]
            self._free_ckpt.append(slot)

    # ---- what the step records show --------------------------------------------------------
    @property
    def num_checkpoints(self) -> int:
        return len(self._by_hash)

    def holders(self) -> dict[str, int]:
        """seq_id -> its live slot."""
        return {seq_id: h.live for seq_id, h in self._seqs.items()}

    def usage(self) -> dict[str, int]:
        """The StepRecord fields of the state pool."""
        return {"state_slots_total": self.live,
                "state_slots_used": self.live - len(self._free_live),
                "state_checkpoints": self.num_checkpoints,
                "state_checkpoint_capacity": self.checkpoints,
                "state_checkpoint_hits": self.hits, "state_slot_bytes": self.slot_bytes}

    def check_invariants(self) -> None:
        """Every slot is in exactly one place: free, held or kept as a checkpoint."""
        places: dict[int, int] = {}
        held = [s for h in self._seqs.values() for s in (h.live, *h.step)]
        for slot in (*self._free_live, *self._free_scratch, *self._free_ckpt, *held,
                     *self._by_hash.values()):
            places[slot] = places.get(slot, 0) + 1
        wrong = {s: n for s, n in places.items() if n != 1}
        if wrong or len(places) != self.total:
            raise AssertionError(f"state slots misplaced: {wrong or 'some missing'}")
        pinned = [s for h in self._seqs.values() for s in h.pinned]
        if sorted(pinned) != sorted(s for s, n in self._pins.items() for _ in range(n)):
            raise AssertionError("checkpoint pins do not match the sequences' holds")
