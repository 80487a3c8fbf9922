from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, KVCopy, NoFreeBlocksError


def test_allocate_grows_table_on_demand_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == []  # still fits in block 0
    assert bm.allocate("a", 5) == [1]
    assert bm.block_table("a") == [0, 1]
    assert bm.num_free_blocks == 6
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check_invariants()


def test_allocation_beyond_the_pool_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 8)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 1)
    assert bm.block_table("b") == []
    assert not bm.can_allocate(1)
    bm.check_invariants()


def test_prefix_hit_shares_full_blocks_by_ref_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks + 2 tokens
    assert bm.match_prefix("a", prompt) == 0
    bm.allocate("a", 10)
    bm.register_full_blocks("a", prompt, num_computed=10)
    assert bm.match_prefix("b", prompt) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    shared = bm.block_table("a")[0]
    assert bm.blocks[shared].ref_count == 2
    assert bm.stats.queries == 20 and bm.stats.hits == 8
    bm.check_invariants()


def test_tokens_given_lazily_are_built_only_when_a_block_has_filled():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    calls = []

    def built() -> list[int]:
        calls.append(1)
        return tokens

    def builds(manager: BlockManager, seq_id: str, computed: int) -> bool:
        before = len(calls)
        manager.register_full_blocks(seq_id, built, computed)
        return len(calls) > before

    bm.allocate("a", 10)
    assert not builds(bm, "a", 3)
    assert builds(bm, "a", 4)
    assert not builds(bm, "a", 7)  # the first block is keyed, the second not full
    assert builds(bm, "a", 8)
    assert not builds(bm, "a", 10)
    assert bm.block_hash("a", 1) is not None and bm.block_hash("a", 2) is None
    unkeyed = BlockManager(8, 4, enable_prefix_caching=False)
    unkeyed.allocate("x", 9)
    assert not builds(unkeyed, "x", 9)


def test_prefix_match_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two blocks
    bm.match_prefix("a", prompt)
    bm.allocate("a", 8)
    bm.register_full_blocks("a", prompt, 8)
    # Only the first block may be reused: the last token needs its logits, and a shared
    # block must never be written again.
    assert bm.match_prefix("b", prompt) == 4


def test_different_prefix_does_not_hit_even_if_a_later_block_matches():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.match_prefix("a", a)
    bm.allocate("a", 5)
    bm.register_full_blocks("a", a, 5)
    assert bm.match_prefix("b", [9, 9, 3, 4, 5]) == 0  # block [3,4] follows another parent


def test_released_prefix_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    for name, prompt in (("a", [1, 2, 3]), ("b", [7, 8, 9])):
        bm.match_prefix(name, prompt)
        bm.allocate(name, 3)
        bm.register_full_blocks(name, prompt, 3)
        bm.free(name)
    assert bm.num_cached_blocks == 2  # [1,2] and [7,8]; partial blocks went to the free list
    assert bm.num_free_blocks == 4
    # Taking 3 blocks uses the 2 free ones, then evicts the least recently used cached block.
    bm.allocate("c", 6)
    assert bm.stats.evictions == 1
    assert bm.match_prefix("d", [1, 2, 3]) == 0  # [1,2] was older: evicted
    assert bm.match_prefix("e", [7, 8, 9]) == 2  # [7,8] survived
    bm.check_invariants()


def test_hit_on_a_cached_block_revives_it():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.match_prefix("a", [1, 2, 3])
    bm.allocate("a", 3)
    bm.register_full_blocks("a", [1, 2, 3], 3)
    bm.free("a")
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix("b", [1, 2, 5]) == 2
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 1
    bm.check_invariants()


def test_free_is_idempotent_and_disabled_prefix_cache_never_hits():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    bm.match_prefix("a", [1, 2, 3])
    bm.allocate("a", 3)
    bm.register_full_blocks("a", [1, 2, 3], 3)
    bm.free("a")
    bm.free("a")
    assert bm.match_prefix("b", [1, 2, 3]) == 0
    assert bm.num_cached_blocks == 0
    bm.check_invariants()


# ---- placement: each sequence's blocks follow one another where the free blocks allow ------

def test_growing_sequences_keep_their_blocks_consecutive_while_they_interleave():
    bm = BlockManager(num_blocks=64, block_size=4)
    bm.allocate("a", 12)  # an empty pool: from its first block
    bm.allocate("b", 12)  # the middle of the largest free run, [3, 64)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.block_table("b") == [33, 34, 35]
    for tokens in range(13, 13 + 4 * 8, 4):  # decode steps: each takes a block in turn
        bm.allocate("a", tokens)
        bm.allocate("b", tokens)
    assert bm.block_table("a") == list(range(0, 11))
    assert bm.block_table("b") == list(range(33, 44))
    bm.check_invariants()


def test_a_sequence_whose_next_block_is_taken_moves_to_the_middle_of_the_largest_run():
    bm = BlockManager(num_blocks=16, block_size=1)
    bm.allocate("a", 2)  # [0, 1]
    bm.allocate("b", 2)  # the middle of [2, 16): [9, 10]
    bm.allocate("c", 3)  # the middle of [2, 9), the larger run: [5, 6, 7]
    bm.allocate("c", 4)  # 8 is free: c goes on
    assert bm.block_table("c") == [5, 6, 7, 8]
    bm.allocate("c", 5)  # 9 is b's: the largest run is [11, 16), its middle 13
    assert bm.block_table("c") == [5, 6, 7, 8, 13]
    bm.free("a")  # [0, 5) is free again: now the largest run, and it begins the pool
    bm.allocate("d", 1)
    assert bm.block_table("d") == [0]
    bm.check_invariants()


def test_blocks_freed_by_trim_are_taken_again_in_place():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", 8)  # [0, 1, 2, 3]
    assert bm.trim("a", 3) == [2, 3]  # rejected drafts' blocks
    assert bm.allocate("a", 8) == [2, 3]
    bm.check_invariants()


# ---- copy_partial: rows of a block shared in part are copied ---------------------------------


def finished(bm: BlockManager, seq_id: str, tokens: list[int], computed: int) -> list[int]:
    """A sequence that computed `computed` of `tokens` and ended; returns its table."""
    bm.match_prefix(seq_id, tokens)
    bm.allocate(seq_id, computed)
    bm.register_full_blocks(seq_id, tokens, computed)
    table = bm.block_table(seq_id)
    bm.register_tail(seq_id, tokens, computed)
    bm.free(seq_id)
    return table


def test_a_repeated_prompt_copies_the_rows_of_the_last_part_filled_block():
    bm = BlockManager(num_blocks=8, block_size=4, copy_partial=True)
    prompt = list(range(10))  # two full blocks + 2 tokens
    table = finished(bm, "a", prompt + [50, 51], 11)  # the reply's first token computed too
    # Whole blocks by reference as before, then the tail's first row by a copy: one token
    # (the last, whose logits are needed) left to compute.
    assert bm.match_prefix("b", prompt) == 9
    new = bm.block_table("b")
    assert new[:2] == table[:2] and new[2] not in table
    assert bm.take_copies() == [KVCopy("b", table[2], new[2], 1)]
    assert bm.take_copies() == []
    assert bm.stats.copied == 1 and bm.stats.hits == 9
    bm.check_invariants()
    # The tail stays cached: a third request takes it again.
    bm.free("b")
    assert bm.match_prefix("c", prompt) == 9
    bm.check_invariants()


def test_a_prompt_of_whole_blocks_copies_all_but_the_last_token_of_its_last_block():
    bm = BlockManager(num_blocks=8, block_size=4, copy_partial=True)
    prompt = list(range(8))
    table = finished(bm, "a", prompt, 8)
    assert bm.match_prefix("b", prompt) == 7
    assert bm.take_copies() == [KVCopy("b", table[1], bm.block_table("b")[1], 3)]
    bm.check_invariants()


def test_a_prompt_that_parts_inside_a_block_copies_the_rows_before_it():
    bm = BlockManager(num_blocks=8, block_size=4, copy_partial=True)
    table = finished(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    assert bm.match_prefix("b", [1, 2, 3, 4, 5, 6, 0, 0, 0]) == 6  # 5, 6 copied, 0 differs
    assert bm.take_copies() == [KVCopy("b", table[1], bm.block_table("b")[1], 2)]
    # Nothing under another chain: a different first block matches nothing.
    assert bm.match_prefix("c", [9, 2, 3, 4, 5, 6, 7]) == 0
    assert bm.take_copies() == []
    bm.check_invariants()


def test_fewer_rows_than_worth_copying_are_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=8, copy_partial=True, min_copy_rows=4)
    table = finished(bm, "a", list(range(14)), 14)
    assert bm.match_prefix("b", list(range(11))) == 8  # 2 rows matched: computed again
    assert bm.take_copies() == []
    assert bm.match_prefix("c", list(range(13))) == 12  # 4 rows: copied
    assert bm.take_copies() == [KVCopy("c", table[1], bm.block_table("c")[1], 4)]
    bm.check_invariants()


def test_a_copy_never_taken_gives_its_source_back_when_its_sequence_goes():
    bm = BlockManager(num_blocks=4, block_size=4, copy_partial=True)
    table = finished(bm, "a", [1, 2, 3, 4, 5, 6], 6)
    assert bm.match_prefix("b", [1, 2, 3, 4, 5, 6, 7]) == 6
    assert bm.blocks[table[1]].ref_count == 1  # held for the copy: not evictable
    bm.free("b")  # e.g. admitted, then no room for its prefill
    assert bm.take_copies() == []
    assert bm.blocks[table[1]].ref_count == 0
    bm.check_invariants()


def test_an_evicted_tail_is_forgotten_and_without_copy_partial_nothing_is_copied():
    bm = BlockManager(num_blocks=2, block_size=4, copy_partial=True)
    finished(bm, "a", [1, 2, 3, 4, 5, 6], 6)
    bm.allocate("x", 8)  # both blocks: the cached ones are evicted
    bm.free("x")
    assert bm.match_prefix("b", [1, 2, 3, 4, 5, 6, 7]) == 0
    bm.check_invariants()
    plain = BlockManager(num_blocks=8, block_size=4)
    finished(plain, "a", [1, 2, 3, 4, 5, 6], 6)
    assert plain.match_prefix("b", [1, 2, 3, 4, 5, 6, 7]) == 4
    assert plain.take_copies() == []


def test_an_emptied_manager_keeps_the_settings_and_hooks_and_holds_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, copy_partial=True, min_copy_rows=2)
    evicted: list[int] = []
    bm.on_evict = evicted.append
    finished(bm, "a", list(range(10)), 10)
    fresh = bm.emptied()
    assert (fresh.num_blocks, fresh.block_size, fresh.enable_prefix_caching, fresh.copy_partial,
            fresh.min_copy_rows) == (8, 4, True, True, 2)
    assert fresh.on_evict == evicted.append  # the state pool's hook, for a hybrid model
    assert fresh.num_free_blocks == 8 and fresh.num_cached_blocks == 0
    assert fresh.match_prefix("b", list(range(10))) == 0
    fresh.check_invariants()


# ---- property-based: random operation sequences never leak or double-free ---------------------

ops = st.lists(
    st.tuples(st.sampled_from(["start", "grow", "commit", "free", "take"]), st.integers(0, 5),
              st.integers(1, 12), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, prefix_caching=st.booleans(), copy_partial=st.booleans())
def test_random_operations_keep_every_block_accounted_for(ops, prefix_caching, copy_partial):
    bm = BlockManager(num_blocks=10, block_size=3, enable_prefix_caching=prefix_caching,
                      copy_partial=copy_partial)
    tokens: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for op, sid, n, flavour in ops:
        seq = f"s{sid}"
        if op == "start" and seq not in tokens:
            # Few distinct token patterns, so prefixes are often shared.
            prompt = [flavour] * n + [sid]
            tokens[seq] = prompt
            computed[seq] = bm.match_prefix(seq, prompt)
            assert computed[seq] < len(prompt)
            assert computed[seq] % bm.block_size == 0 or bm.copy_partial
            assert len(bm.block_table(seq)) == -(-computed[seq] // bm.block_size)
        elif op == "grow" and seq in tokens:
            target = min(len(tokens[seq]), computed[seq] + n)
            needed = bm.blocks_needed(seq, target)
            if bm.can_allocate(needed):
                bm.allocate(seq, target)
                computed[seq] = target
            else:
                with pytest.raises(NoFreeBlocksError):
                    bm.allocate(seq, target)
        elif op == "commit" and seq in tokens:
            bm.register_full_blocks(seq, tokens[seq], computed[seq])
        elif op == "free" and seq in tokens:
            if flavour:  # it ended (its tail kept where it can be), else preempted or failed
                bm.register_tail(seq, tokens[seq], computed[seq])
            bm.free(seq)
            del tokens[seq], computed[seq]
        elif op == "take":
            for c in bm.take_copies():
                assert bm.block_table(c.seq_id)[-1] == c.dest and 0 < c.rows <= bm.block_size
        bm.check_invariants()
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    for seq in list(tokens):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_used_blocks == 0  # only evictable cached blocks remain
