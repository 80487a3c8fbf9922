"""Paged-KV bookkeeping: which block of the pool holds which tokens of which sequence.

No tensors: the pool itself lives in kv_cache.py and is addressed through the block tables
kept here. Full blocks are keyed by a hash chain of their tokens so that a later request with
the same prefix can share them (ref counts); a released hashed block stays cached and is
evicted least-recently-used when no free block is left.

Where a sequence's blocks land in the pool does not change what attention computes, but it
changes how fast the CPU reads them: blocks that follow one another are read faster than
blocks scattered through the pool (benchmarks/results/attention_placement.md). So a growing
sequence takes the block right after its last one when that is free, and a sequence that
starts, or whose next block is taken, starts in the largest run of free blocks: at its start
when the run begins the pool, else in its middle, leaving the first half to the sequence
before the run (the engine's decode: benchmarks/results/build_ab_blocks.md).

With `copy_partial`, a prefix match does not stop at the last whole block: a finished
sequence's last, partly filled block is cached too (keyed by the chain before it and the
tokens it holds), and a prompt that goes on past a matched chain with some of the tokens of a
cached block under that chain (partly filled or full) gets those rows copied into a block of
its own (`take_copies`: the engine copies them in the pool before the step that needs them),
so a repeated prompt computes one token, not up to a block (from `min_copy_rows` rows on, the
pool's `KVPool.min_copy_rows`; fewer are computed again). A shared block is still never
written: the copy is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class NoFreeBlocksError(RuntimeError):
    """The pool cannot provide the blocks asked for (the caller should preempt or wait)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is registered (full, or a finished tail)
    token_ids: tuple[int, ...] = ()  # kept to rule out hash collisions
    parent: int | None = None  # a registered block's chain hash before it


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached
    evictions: int = 0
    copied: int = 0  # of the hits, rows copied from a block shared only in part


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks of `table` already registered in the prefix cache
    hashes: list[int] = field(default_factory=list)  # the chain's hash of each of them

    @property
    def last_hash(self) -> int | None:
        """Hash of block num_hashed - 1 (the chain's tail)."""
        return self.hashes[-1] if self.hashes else None


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))




@dataclass(frozen=True)
class KVCopy:
    """Rows [0, rows) of block `source` to be copied into block `dest` (the same rows), the
    first block of `seq_id`'s own."""

    seq_id: str
    source: int
    dest: int
    rows: int


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # the shorter decides
        if x != y:
            break
        n += 1
    return n


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 copy_partial: bool = False, min_copy_rows: int = 1):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.copy_partial = copy_partial and enable_prefix_caching
        self.min_copy_rows = max(1, min_copy_rows)  # fewer matched rows are computed instead
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = np.ones(num_blocks, dtype=bool)  # never used, or released unhashed
        # Counted as blocks come and go: the scheduler asks for it for every running request
        # each step, and counting the mask each time would scan the pool (check_invariants
        # compares the two).
        self._num_free = num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed, LRU first
        self._by_hash: dict[int, int] = {}
        # copy_partial: (chain hash, first min_copy_rows tokens) -> the registered blocks that
        # follow that chain and start so (a match of fewer rows is not copied, so a prompt
        # looks only at blocks it could copy from), and the copies matched but not yet taken
        # (each holds a reference on its source until then).
        self._children: dict[tuple[int | None, tuple[int, ...]], set[int]] = {}
        self._copies: list[KVCopy] = []
        self._seqs: dict[str, _SeqBlocks] = {}
        self.stats = PrefixCacheStats()
        # Called with a block's hash when it is evicted from the prefix cache (the state
        # checkpoints kept at its end go with it, engine/state_slots.py).
        self.on_evict: Callable[[int], None] | None = None

    def emptied(self) -> BlockManager:
        """A manager with these settings and hooks and no block in use or cached (for a pool
        that was reset)."""
        fresh = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching,
                             self.copy_partial, self.min_copy_rows)
        fresh.on_evict = self.on_evict
        return fresh

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used or cached with no holder (evictable)."""
        return self._num_free + len(self._cached)

    @property
    def num_empty_blocks(self) -> int:
        """Blocks holding nothing worth keeping (never used, or released without a hash)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        seq = self._seqs.get(seq_id)
        return list(seq.table) if seq else []

    def holders(self) -> dict[int, list[str]]:
        """block id -> ids of the sequences whose tables hold it (for the dashboard)."""
        out: dict[int, list[str]] = {}
        for seq_id, seq in self._seqs.items():
            for b in seq.table:
                out.setdefault(b, []).append(seq_id)
        return out

    def cached_block_ids(self) -> list[int]:
        return list(self._cached)

    def blocks_needed(self, seq_id: str, num_tokens: int) -> int:
        have = len(self._seqs[seq_id].table) if seq_id in self._seqs else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, seq_id: str, token_ids: list[int]) -> int:
        """Start a sequence's table with the cached full blocks of its prefix (and, with
        copy_partial, a block of its own for the rows it copies after them).

        Returns how many tokens are covered. At least one token is always left to compute
        (its logits are needed), so a prefix that is a whole number of blocks stops one block
        short (with copy_partial, one token short); a shared block is never written again.
        """
        if seq_id in self._seqs and self._seqs[seq_id].table:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        if not self.enable_prefix_caching:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        self.stats.queries += len(token_ids)
        parent: int | None = None
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._take(block_id)
            seq.table.append(block_id)
            seq.hashes.append(h)
            parent = h
        seq.num_hashed = len(seq.table)
        covered = len(seq.table) * self.block_size
        if self.copy_partial:
            covered += self._match_rows(seq_id, parent, token_ids[covered:len(token_ids) - 1])
        self.stats.hits += covered
        return covered

    def _match_rows(self, seq_id: str, parent: int | None, tokens: list[int]) -> int:
        """The most leading tokens of `tokens` that a registered block under `parent` holds:
        a block of the sequence's own takes them by a copy (KVCopy). Returns how many."""
        best, source = 0, None
        for block_id in self._children.get((parent, tuple(tokens[:self.min_copy_rows])), ()):
            n = _common_prefix(self.blocks[block_id].token_ids, tokens)
            if n > best:
                best, source = n, block_id
        if best < self.min_copy_rows:
            return 0
        seq = self._seqs[seq_id]
        self._take(source)  # held until the copy is taken: not evicted by the allocation below
        if not self.num_free_blocks:
            self._release(source)
            return 0
        dest = self._pop_free(seq.table[-1] if seq.table else None)
        seq.table.append(dest)
        self._copies.append(KVCopy(seq_id, source, dest, best))
        self.stats.copied += best
        return best

    def take_copies(self) -> list[KVCopy]:
        """The copies matched since the last call, to be done in the pool before the next step
        runs and before anything is allocated again: their sources are released now (cached,
        so an allocation could evict them)."""
        copies, self._copies = self._copies, []
        for c in copies:
            self._release(c.source)
        return copies

    def register_tail(self, seq_id: str, token_ids: list[int], num_computed: int) -> None:
        """Key a sequence's last block when it is partly filled with computed tokens (called
        as it ends, before `free`): a later prompt that goes on the same way copies its rows."""
        seq = self._seqs.get(seq_id)
        if not self.copy_partial or seq is None:
            return
        i, rows = seq.num_hashed, num_computed - seq.num_hashed * self.block_size
        if not 0 < rows < self.block_size or i >= len(seq.table):
            return
        block = self.blocks[seq.table[i]]
        tokens = tuple(token_ids[i * self.block_size:num_computed])
        h = chain_hash(seq.last_hash, tokens)
        if block.ref_count == 1 and block.block_hash is None and h not in self._by_hash:
            self._index(block, h, tokens, seq.last_hash)

    def register_full_blocks(self, seq_id: str,
                             token_ids: list[int] | Callable[[], list[int]],
                             num_computed: int) -> None:
        """Key the blocks that are now full of computed tokens, so later requests can share them.
        token_ids: the sequence's tokens, or a function giving them, called only when a block
        has filled (a step's caller: building the list takes time in the sequence's length)."""
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        full = min(num_computed // self.block_size, len(seq.table))
        if seq.num_hashed < full and callable(token_ids):
            token_ids = token_ids()
        while seq.num_hashed < full:
            i = seq.num_hashed
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(seq.last_hash, tokens)
            block = self.blocks[seq.table[i]]
            if h not in self._by_hash and block.block_hash is None:
                self._index(block, h, tokens, seq.last_hash)
            seq.hashes.append(h)
            seq.num_hashed += 1

    def block_hash(self, seq_id: str, i: int) -> int | None:
        """The prefix-cache hash of the sequence's block i (None: not registered yet)."""
        hashes = self._seqs[seq_id].hashes
        return hashes[i] if i < len(hashes) else None

    def keep_prefix(self, seq_id: str, num_blocks: int) -> None:
        """Give back the blocks a prefix match gave the sequence past its first num_blocks (a
        model with recurrent layers resumes only where a state checkpoint is kept)."""
        seq = self._seqs[seq_id]
        if len(seq.table) != seq.num_hashed:
            raise ValueError(f"sequence {seq_id} has computed blocks of its own")
        dropped = seq.table[num_blocks:]
        del seq.table[num_blocks:], seq.hashes[num_blocks:]
        seq.num_hashed = len(seq.table)
        self.stats.hits -= len(dropped) * self.block_size
        for block_id in reversed(dropped):
            self._release(block_id)

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow the sequence's table to hold `num_tokens` tokens; returns the new block ids."""
        seq = self._seqs.setdefault(seq_id, _SeqBlocks())
        needed = self.blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        start = len(seq.table)
        for _ in range(needed):
            seq.table.append(self._pop_free(seq.table[-1] if seq.table else None))
        return seq.table[start:]

    def trim(self, seq_id: str, num_tokens: int) -> list[int]:
        """Shrink the table to the blocks `num_tokens` tokens need (rejected drafts' rows give
        their blocks back); returns the freed ids. Only blocks past every registered one go:
        they hold no computed token worth keeping."""
        seq = self._seqs[seq_id]
        keep = -(-num_tokens // self.block_size)
        if keep < seq.num_hashed:
            raise ValueError(f"cannot trim {seq_id} below its {seq.num_hashed} cached blocks")
        freed = seq.table[keep:]
        del seq.table[keep:]
        for block_id in reversed(freed):
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.block_hash is not None:
                raise RuntimeError(f"block {block_id} is shared or cached: not a draft's")
            block.ref_count = 0
            self._put_free(block_id)
        return freed

    def free(self, seq_id: str) -> None:
        """Release a sequence's blocks (finish, cancel, error or preemption). Idempotent."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for c in [c for c in self._copies if c.seq_id == seq_id]:  # never to be done
            self._copies.remove(c)
            self._release(c.source)
        # Tail first, so that when the LRU evicts it takes the end of a chain before its head.
        for block_id in reversed(seq.table):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._cached[block_id] = None
            else:
                self._put_free(block_id)

    # ---- internals -----------------------------------------------------------------------
    def _index(self, block: Block, h: int, tokens: tuple[int, ...], parent: int | None) -> None:
        block.block_hash, block.token_ids, block.parent = h, tokens, parent
        self._by_hash[h] = block.block_id
        if self.copy_partial and len(tokens) >= self.min_copy_rows:
            self._children.setdefault(self._child_key(block), set()).add(block.block_id)

    def _child_key(self, block: Block) -> tuple[int | None, tuple[int, ...]]:
        return block.parent, block.token_ids[:self.min_copy_rows]

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        block.ref_count += 1

    def _put_free(self, block_id: int) -> None:
        self._free[block_id] = True
        self._num_free += 1

    def _pop_free(self, after: int | None) -> int:
        """A block for the sequence whose last block is `after` (None: it has none): a free
        one where the module's docstring says, else the least recently used cached one."""
        if self._num_free:
            block_id = self._free_block_after(after)
            self._free[block_id] = False
            self._num_free -= 1
        else:
            block_id, _ = self._cached.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            del self._by_hash[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_hash)
            siblings = self._children.get(self._child_key(block))
            if siblings is not None:
                siblings.discard(block_id)
                if not siblings:
                    del self._children[self._child_key(block)]
            block.block_hash = None
            block.token_ids = ()
            block.parent = None
            self.stats.evictions += 1
        block = self.blocks[block_id]
        block.ref_count = 1
        return block_id

    def _free_block_after(self, after: int | None) -> int:
        if after is not None and after + 1 < self.num_blocks and self._free[after + 1]:
            return after + 1
        # The runs of free blocks: edges where the mask changes, padded so every run closes.
        edges = np.flatnonzero(np.diff(self._free, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]  # each run is [start, end)
        i = int(np.argmax(ends - starts))  # the first of the largest
        start, end = int(starts[i]), int(ends[i])
        return start if start == 0 else (start + end) // 2

    def check_invariants(self) -> None:
        """Every block is in exactly one place; ref counts equal the number of tables holding it."""
        held: dict[int, int] = {}
        for seq in self._seqs.values():
            for b in seq.table:
                held[b] = held.get(b, 0) + 1
        for c in self._copies:  # a copy not yet taken holds its source
            held[c.source] = held.get(c.source, 0) + 1
        free, cached = set(np.flatnonzero(self._free).tolist()), set(self._cached)
        if len(free) != self._num_free:
            raise AssertionError(f"{self._num_free} free blocks counted, {len(free)} marked")
        for block in self.blocks:
            refs = held.get(block.block_id, 0)
            if block.ref_count != refs:
                raise AssertionError(f"block {block.block_id}: ref {block.ref_count} != {refs}")
            places = (block.block_id in free) + (block.block_id in cached) + (refs > 0)
            if places != 1:
                raise AssertionError(f"block {block.block_id} is in {places} places")
            if block.block_id in cached and block.block_hash is None:
                raise AssertionError(f"cached block {block.block_id} has no hash")
        for h, b in self._by_hash.items():
            if self.blocks[b].block_hash != h:
                raise AssertionError(f"hash index points at block {b} with another hash")
        children = {(self._child_key(block), block.block_id) for block in self.blocks
                    if block.block_hash is not None
                    and len(block.token_ids) >= self.min_copy_rows} if self.copy_partial else set()
        if {(k, b) for k, bs in self._children.items() for b in bs} != children:
            raise AssertionError("the index of blocks by the chain before them is stale")
