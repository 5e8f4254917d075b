"""One pool, one block table per layer group (kvlib.cache.hybrid_blocks, chapter 17): vLLM's
grouping rule, the longest hit against a brute force over random operations, chapter 3's
equation against the allocator's bytes for every shipped full/sliding configuration, the next
turn's hit at every length and after dead window blocks are evicted, and refusals that change
nothing."""

import random

import pytest

from kvlib import memory as M
from kvlib.cache.block_pool import BlockPool
from kvlib.cache.hybrid_blocks import HybridBlockManager, LayerGroup, fill_pool, group_layers
from kvlib.errors import OutOfBlocksError


def gemma3_windows(num_layers=62, window=1024):  # every sixth layer global
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_grouping_follows_vllm_rule():
    groups = group_layers(gemma3_windows())
    sliding = [g for g in groups if g.window == 1024]
    full = [g for g in groups if g.window is None]
    assert [len(g.layers) for g in full] == [10] and len(sliding) == 6
    assert {g.size for g in groups} == {10}
    assert sum(g.size - len(g.layers) for g in sliding) == 8  # 52 layers in room for 60
    assert sorted(i for g in groups for i in g.layers) == list(range(62))
    assert sliding[0].layers[:3] == (0, 7, 14)  # the 1st, 7th, 13th sliding layers
    # 12 sliding + 13 full: under 1.5x apart, so the larger count is the room (vLLM's example)
    mixed = group_layers([128] * 12 + [None] * 13)
    assert [(len(g.layers), g.size) for g in mixed] == [(12, 13), (13, 13)]
    assert group_layers([None] * 4) == [LayerGroup((0, 1, 2, 3), None, 4)]


@pytest.mark.parametrize("windows", [[], [None, 0], [None, 2.5]])
def test_grouping_rejects_bad_windows(windows):
    with pytest.raises((ValueError, TypeError), match="windows"):
        group_layers(windows)


def brute_force_hit(manager, tokens):
    """The largest L (blocks) below the prompt's last token at which every block each group
    needs is in the prefix cache, straight from the definition."""
    bs = manager.block_size
    for hit in range((len(tokens) - 1) // bs, 0, -1):
        ok = True
        for g, group in enumerate(manager.groups):
            chain = manager._chain(g, tokens, hit)
            needed = range(hit)
            if group.window is not None:
                dead_before = max(0, hit * bs - group.window + 1) // bs
                sinks = range(-(-manager.sink_tokens // bs))
                needed = [i for i in needed if i >= dead_before or i in sinks]
            ok = ok and all(manager.pool.lookup(chain[i]) is not None for i in needed)
        if ok:
            return hit * bs
    return 0


@pytest.mark.parametrize("seed", range(100))
def test_longest_hit_and_invariants_under_random_operations(seed):
    rng = random.Random(seed)
    windows = [rng.choice([None, 3, 5, 8]) for _ in range(rng.randint(1, 5))]
    manager = HybridBlockManager(
        BlockPool(rng.randint(12, 60), rng.choice([1, 2, 4])),
        group_layers(windows),
        sink_tokens=rng.choice([0, 0, 2]),
    )
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    live, next_id = {}, 0
    for _ in range(40):
        op = rng.random()
        if op < 0.4:
            tokens = rng.choice(prefixes)[: rng.randint(1, 30)] + [rng.randrange(3)]
            expected = brute_force_hit(manager, tokens)
            assert manager.longest_hit(tokens) == expected
            before = (manager.pool.num_free_blocks, dict(manager.managers[0].block_tables))
            try:
                assert manager.allocate(next_id, tokens) == expected
                live[next_id] = tokens
                next_id += 1
            except OutOfBlocksError:
                assert (manager.pool.num_free_blocks, manager.managers[0].block_tables) == before
        elif op < 0.7 and live:
            seq = rng.choice(sorted(live))
            free_before = manager.pool.num_free_blocks
            try:
                manager.extend(seq, [rng.randrange(3) for _ in range(rng.randint(1, 5))])
            except OutOfBlocksError:
                assert manager.pool.num_free_blocks == free_before
            manager.free_dead(seq)
        elif live:
            seq = rng.choice(sorted(live))
            manager.free(seq)
            del live[seq]
        manager.check_invariants()
        for seq in live:  # two groups never share a block (their hashes are salted)
            tables = manager.tables(seq)
            for a in range(len(tables)):
                for b in range(a):
                    shared = set(tables[a]) & set(tables[b]) - {manager.null_block}
                    assert not shared


def sequence_bytes(manager, seq, per_layer_token_bytes):
    """Bytes one sequence's tables hold in its groups' real layers (padding and null excluded)."""
    return sum(
        sum(b != manager.null_block for b in table)
        * manager.block_size
        * len(group.layers)
        * per_layer_token_bytes
        for table, group in zip(manager.tables(seq), manager.groups)
    )


@pytest.mark.parametrize(
    "name", ["mistral-7b-v0.1", "gemma-2-9b", "gemma-3-27b", "gpt-oss-20b", "qwen2.5-7b"]
)
def test_the_equation_equals_the_allocators_bytes(name):
    config = M.shipped_configs()[name]
    specs = M.layer_specs(config)
    assert {s.kind for s in specs} <= {"full", "sliding"}
    (per_token,) = {2 * s.elements_per_token for s in specs}  # bfloat16 bytes, one layer
    groups = group_layers([s.token_cap if s.kind == "sliding" else None for s in specs])
    block_size, top = 16, min(max(3 * max(s.token_cap or 0 for s in specs), 4096), 12288)
    manager = HybridBlockManager(BlockPool(10_000, block_size, enable_prefix_caching=False), groups)
    manager.allocate("s", range(block_size))
    checked = 0
    for n in range(block_size, top + 1, block_size):  # every block-aligned length
        if n > block_size:
            manager.extend("s", range(n - block_size, n))
        manager.free_dead("s")
        expected = M.kv_cache_bytes(config, n, cache_dtype="bfloat16")
        assert sequence_bytes(manager, "s", per_token) == expected, n
        checked += 1
    assert checked >= 256  # past three windows and 4,096 tokens


@pytest.mark.parametrize("window", [8, 6])
def test_the_next_turn_hits_at_every_length(window):
    """A conversation's next turn resumes at the first turn's last block boundary, whatever the
    first turn's length (one a block boundary or not) and whether the window is a multiple of
    the block size."""
    for n in range(1, 60):
        manager = HybridBlockManager(BlockPool(64, 4), group_layers([window, None]))
        turn_1 = list(range(n))
        manager.allocate("turn 1", turn_1[: min(n, 5)])
        for start in range(5, n, 3):  # prefill, then steps of 3, dead blocks freed after each
            manager.free_dead("turn 1")
            manager.extend("turn 1", turn_1[start : start + 3])
        manager.free("turn 1")
        assert manager.longest_hit(turn_1 + [97, 98, 99]) == n // 4 * 4, n
        manager.check_invariants()


def test_a_hit_at_the_end_survives_the_eviction_of_dead_window_blocks():
    manager = HybridBlockManager(BlockPool(1 + 30 + 8, 4), group_layers([8, 8, None]))
    turn_1 = list(range(40))  # 10 blocks in each of 3 groups
    manager.allocate("turn 1", turn_1)
    manager.free("turn 1")  # the 16 dead window blocks join the free queue before the rest
    manager.allocate("other", range(1000, 1032))  # 24 blocks: 8 never used, then those 16
    assert manager.cached_blocks(turn_1) == [2, 2, 10]
    assert manager.longest_hit(turn_1 + [97]) == 40  # needs only blocks 8 and 9 of a window
    assert manager.managers[0].num_cached_prefix_blocks(turn_1 + [97])[0] == 0  # chapter 7's rule
    assert manager.longest_hit(turn_1[:20] + [55]) == 0  # the window at 20 was evicted
    manager.check_invariants()


def test_a_hit_needs_the_sinks_too():
    manager = HybridBlockManager(BlockPool(64, 4), group_layers([8, None]), sink_tokens=4)
    tokens = list(range(40))
    manager.allocate("a", tokens)
    manager.free("a")
    assert manager.longest_hit(tokens + [1]) == 40
    manager.pool.cached_blocks.pop(manager._chain(0, tokens, 1)[0])  # evict the sink block
    assert manager.longest_hit(tokens + [1]) == 0


def test_per_group_tables_admit_more_sequences_than_one_table():
    windows = gemma3_windows(12, window=64)  # 10 sliding, 2 full
    admitted = {}
    for label, groups in (("one", group_layers([None] * 12)), ("per group", group_layers(windows))):
        size = groups[0].size
        pool = BlockPool(12 * 4096 // (16 * size), 16, enable_prefix_caching=False)
        admitted[label] = fill_pool(HybridBlockManager(pool, groups), 1024, chunk=256)
    assert admitted["one"] == 4096 // 1024
    assert admitted["per group"] > 2 * admitted["one"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sink_tokens"):
        HybridBlockManager(BlockPool(8, 4), group_layers([None]), sink_tokens=-1)
    with pytest.raises(ValueError, match="groups"):
        HybridBlockManager(BlockPool(8, 4), [])
    manager = HybridBlockManager(BlockPool(8, 4), group_layers([None]))
    with pytest.raises(ValueError, match="token_ids"):
        manager.allocate("a", [])
    manager.allocate("a", [1])
    with pytest.raises(ValueError, match="seq_id"):
        manager.allocate("a", [1])
    with pytest.raises(ValueError, match="chunk"):
        fill_pool(manager, 8, chunk=0)
