"""kvlib.cache.block_pool: the allocator's rules one by one, then its invariants under a hypothesis
state machine of random operations (allocate with prefix hits, append with copy-on-write, fork,
free, double frees)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.errors import OutOfBlocksError


def test_allocate_takes_least_recently_freed_first_and_raises_when_out():
    pool = BlockPool(4, 2)
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free_blocks == 1
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocksError, match="2 blocks needed, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # nothing taken
    pool.free([1])
    pool.free([0])
    assert pool.allocate(3) == [3, 1, 0]  # the free queue's order: 3, then 1, then 0


def test_free_catches_a_double_free_and_changes_nothing():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"block {a} freed 1 time\\(s\\) but held 0"):
        pool.free([b, a])
    assert pool.blocks[b].ref_cnt == 1  # b was not freed either
    with pytest.raises(ValueError, match="block_ids: expected ids in \\[0, 3\\), got 7"):
        pool.free([7])


def test_hash_chain_depends_on_the_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9]), [3, 4]
    )
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])
    assert len(first) == 32  # SHA-256


def test_prefix_hit_reuses_full_blocks_and_leaves_the_last_token_to_compute():
    manager = BlockManager(BlockPool(8, 4))
    prompt = list(range(12))  # three full blocks
    assert manager.allocate("a", prompt) == 0
    # a second request with the same 12 tokens: the hit is capped at 11 tokens -> 2 full blocks
    assert manager.allocate("b", prompt) == 8
    assert manager.block_tables["b"][:2] == manager.block_tables["a"][:2]
    assert manager.block_tables["b"][2] != manager.block_tables["a"][2]
    # a different second block: only the first block is shared
    assert manager.allocate("c", prompt[:4] + [99] * 5) == 4
    manager.check_invariants()
    # freed blocks stay cached until evicted
    manager.free("a")
    manager.free("b")
    manager.free("c")
    assert manager.allocate("d", prompt + [5]) == 12
    manager.check_invariants()


def test_append_allocates_at_block_boundaries_and_copies_a_shared_partial_block():
    manager = BlockManager(BlockPool(6, 4))
    manager.allocate("a", [1, 2, 3, 4, 5])  # 1 full block + 1 slot of the second
    manager.fork("a", "b")
    assert manager.block_tables["a"] == manager.block_tables["b"]
    shared_last = manager.block_tables["a"][1]
    slot = manager.append_slot("b", 6)  # b writes into the shared partial block: copy first
    ((src, dst),) = manager.copies
    assert src == shared_last and manager.block_tables["b"][1] == dst != shared_last
    assert slot == dst * 4 + 1 and manager.block_tables["a"][1] == shared_last
    assert manager.pool.blocks[shared_last].ref_cnt == 1
    manager.append_slot("a", 7)  # a now holds its block alone: no copy
    assert len(manager.copies) == 1
    for token in (8, 9, 10):
        manager.append_slot("a", token)
    assert len(manager.block_tables["a"]) == 3  # 8 tokens filled 2 blocks; the 9th opened a third
    manager.check_invariants()


def test_slot_mapping_follows_the_block_table():
    manager = BlockManager(BlockPool(5, 4))
    manager.pool.allocate(2)  # blocks 0 and 1 busy elsewhere
    manager.allocate(0, list(range(6)))
    table = manager.block_tables[0]
    assert [manager.slot(0, t) for t in range(6)] == [table[t // 4] * 4 + t % 4 for t in range(6)]
    with pytest.raises(ValueError, match="position: expected an int in \\[0, 6\\), got 6"):
        manager.slot(0, 6)


def test_allocation_that_does_not_fit_changes_nothing():
    manager = BlockManager(BlockPool(3, 4))
    manager.allocate("a", list(range(8)))
    assert not manager.can_allocate(list(range(100, 108)))
    with pytest.raises(OutOfBlocksError, match="needs blocks for 8 tokens, 1 of 3 blocks free"):
        manager.allocate("b", list(range(100, 108)))
    assert "b" not in manager.block_tables
    manager.check_invariants()


class AllocatorMachine(RuleBasedStateMachine):
    """Random sequences of allocator operations; the invariants are checked after every one."""

    def __init__(self):
        super().__init__()
        self.manager = BlockManager(BlockPool(24, 4))
        self.next_id = 0
        self.ops = 0

    @property
    def live(self):
        return sorted(self.manager.block_tables)

    @rule(
        length=st.integers(1, 20),
        shared=st.integers(0, 12),
        vocab=st.integers(2, 5),
        data=st.data(),
    )
    def allocate(self, length, shared, vocab, data):
        self.ops += 1
        prefix = []
        if self.live and shared:  # reuse the start of a live sequence: prefix hits
            source = data.draw(st.sampled_from(self.live))
            prefix = self.manager.token_ids[source][:shared]
        tokens = prefix + data.draw(
            st.lists(st.integers(0, vocab), min_size=length, max_size=length)
        )
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self.manager.can_allocate(tokens):
            covered = self.manager.allocate(seq_id, tokens)
            assert covered % 4 == 0 and covered <= len(tokens) - 1
        else:
            with pytest.raises(OutOfBlocksError):
                self.manager.allocate(seq_id, tokens)

    @precondition(lambda self: self.manager.block_tables)
    @rule(data=st.data(), token=st.integers(0, 5))
    def append(self, data, token):
        self.ops += 1
        seq_id = data.draw(st.sampled_from(self.live))
        before = list(self.manager.block_tables[seq_id])
        try:
            slot = self.manager.append_slot(seq_id, token)
        except OutOfBlocksError:
            assert self.manager.block_tables[seq_id] == before
            return
        position = self.manager.num_tokens(seq_id) - 1
        assert slot == self.manager.slot(seq_id, position)
        block = self.manager.block_tables[seq_id][position // 4]
        assert self.manager.pool.blocks[block].ref_cnt == 1  # written only through a private block

    @precondition(lambda self: self.manager.block_tables)
    @rule(data=st.data())
    def fork(self, data):
        self.ops += 1
        parent = data.draw(st.sampled_from(self.live))
        self.manager.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.manager.block_tables)
    @rule(data=st.data())
    def truncate(self, data):  # a fork's recomputed token (chapter 13), a speculation's rollback
        self.ops += 1
        seq_id = data.draw(st.sampled_from(self.live))
        n = self.manager.num_tokens(seq_id)
        keep = data.draw(st.integers(1, n))
        try:
            self.manager.truncate(seq_id, keep)
        except OutOfBlocksError:
            return
        assert self.manager.num_tokens(seq_id) == keep

    @precondition(lambda self: self.manager.block_tables)
    @rule(data=st.data())
    def free(self, data):
        self.ops += 1
        seq_id = data.draw(st.sampled_from(self.live))
        table = list(self.manager.block_tables[seq_id])
        self.manager.free(seq_id)
        with pytest.raises(ValueError, match="double free"):  # freeing its blocks again
            self.manager.pool.free(table[:1] * (self.manager.pool.blocks[table[0]].ref_cnt + 1))

    @invariant()
    def allocator_invariants(self):
        self.manager.check_invariants()

    def teardown(self):
        AllocatorMachine.total_ops += self.ops


AllocatorMachine.total_ops = 0


def test_a_rolled_back_block_leaves_the_prefix_cache():
    """Speculative decoding's pitfall (chapter 16): a block filled by a token later rolled back
    keeps its slots for the accepted token; a prompt that really has the rejected token there must
    not find the old hash on the new K/V."""
    manager = BlockManager(BlockPool(8, 4))
    manager.allocate("a", [1, 2, 3, 4, 5])
    for token in (6, 7, 8):  # 8 fills block 1, which is hashed for the prefix cache
        manager.append_slot("a", token)
    manager.truncate("a", 7)  # 8 rejected
    manager.append_slot("a", 9)  # the accepted token takes its slot
    manager.check_invariants()
    assert manager.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 10]) == 4  # block 0 only
    assert manager.block_tables["b"][1] != manager.block_tables["a"][1]
    assert manager.allocate("c", [1, 2, 3, 4, 5, 6, 7, 9, 10]) == 8  # the new content is found


def test_blocks_a_rollback_drops_whole_leave_the_prefix_cache():
    """A draft of 4 tokens fills block 1 and is rejected whole: the block goes back to the pool
    without its hash (its K/V may come from a draft's inexact forward), so a prompt that carries
    those tokens recomputes them."""
    manager = BlockManager(BlockPool(8, 4))
    manager.allocate("a", [1, 2, 3, 4, 5])
    for token in (6, 7, 8, 9):
        manager.append_slot("a", token)  # block 1 = [5, 6, 7, 8], hashed
    manager.truncate("a", 4)
    manager.check_invariants()
    assert manager.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4


def test_allocator_invariants_hold_over_10000_random_operations():
    runner = AllocatorMachine.TestCase
    runner.settings = settings(
        max_examples=120, stateful_step_count=100, deadline=None, derandomize=True, database=None
    )
    AllocatorMachine.total_ops = 0
    runner().runTest()
    assert AllocatorMachine.total_ops >= 10_000, AllocatorMachine.total_ops


def test_pool_snapshots_and_their_animation():
    from kvlib.course.viz import PoolSnapshot, _filled_slots, block_table_animation

    manager = BlockManager(BlockPool(6, 4))
    manager.allocate("A", [1, 2, 3, 4, 5])
    manager.fork("A", "B")
    first = PoolSnapshot.of(manager, "fork")
    slot = manager.append_slot("B", 9)  # copy-on-write of A's partial second block
    second = PoolSnapshot.of(manager, "append", [slot])
    assert first.block_tables == {"A": [0, 1], "B": [0, 1]} and first.ref_cnt.tolist()[:2] == [2, 2]
    assert second.block_tables["B"] == [0, 2] and second.written == (9,)  # block 2, offset 1
    filled = _filled_slots(second)
    assert filled[4] == ("A", 1) and filled[8] == ("B", 1) and filled[0] == ("A", 2)
    assert set(filled) == {0, 1, 2, 3, 4, 8, 9}
    html = block_table_animation([first, second]).to_jshtml()
    assert html.count("data:image/png;base64") == 2
    with pytest.raises(ValueError, match="snapshots: expected at least one"):
        block_table_animation([])
