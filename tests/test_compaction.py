"""kvlib.cache.compaction: the two passes' plans (the chapter's numbers, and properties on random
eviction patterns), the allocator's half (block tables, hashes, shared blocks), and the cache:
generation from a compacted cache is token-identical to generation from an uncompacted cache
holding the same survivors, on the course model and SmolLM2, for both strategies and repeated
rounds; dead slots never take part in attention; positions come from the map."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.cache.compaction import CompactingPagedCache
from kvlib.cache.compaction_plans import SlotMap, freeable_blocks, plan_hole_filling, plan_repack
from kvlib.cache.eviction_policies import H2O, TOVA, RandomEviction, SnapKV, StreamingLLM
from kvlib.errors import UnsupportedConfigError
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model


@pytest.fixture(scope="module")
def course_model():
    return load_course_model()


def apply(slots: list, moves) -> list:
    """Apply (src, dst) moves to a list the way the cache does: every source read first."""
    values = [slots[s] for s, _ in moves]
    out = list(slots)
    for (_, d), value in zip(moves, values):
        out[d] = value
    return out


# --- the plans ----------------------------------------------------------------------------------


def test_the_chapters_toy_six_blocks_of_four():
    """T2, T9, T13, T21 evicted from 6 blocks x 4 slots: both passes free one block; repack
    copies 18 slots, hole-filling 3 (T20, T22, T23 into the holes at T13, T9, T2)."""
    live = [t not in (2, 9, 13, 21) for t in range(24)]
    assert freeable_blocks(live, 4) == []
    repack, holes = plan_repack(live), plan_hole_filling(live)
    assert len(repack) == 18 and holes == [(23, 2), (22, 9), (20, 13)]
    for moves in (repack, holes):
        after = apply(list(range(24)), moves)[:20]
        assert sorted(after) == [t for t in range(24) if live[t]]
        assert len(freeable_blocks(live, 4)) + (24 - 20) // 4 == 1  # one block back
    assert apply(list(range(24)), repack)[:20] == [t for t in range(24) if live[t]]


def test_scattered_eviction_frees_nothing_until_compacted():
    """16,000 tokens in 1,000 blocks of 16, every 10th kept: no block is empty; a repack leaves
    1,600 slots, 100 blocks: 900 freed. One survivor per block: 93.75% evicted, nothing freed."""
    live = [t % 10 == 0 for t in range(16_000)]
    assert freeable_blocks(live, 16) == []
    after = apply(list(range(16_000)), plan_repack(live))
    assert after[:1600] == list(range(0, 16_000, 10))
    assert 1000 - -(-1600 // 16) == 900
    one_per_block = [t % 16 == 0 for t in range(16_000)]
    assert freeable_blocks(one_per_block, 16) == [] and 1 - sum(one_per_block) / 16_000 == 0.9375
    aligned = [not 160 <= t < 176 for t in range(16_000)]  # block 10 evicted entirely
    assert freeable_blocks(aligned, 16) == [10]


@settings(max_examples=200, deadline=None)
@given(live=st.lists(st.booleans(), max_size=64), start=st.integers(0, 64))
def test_both_plans_pack_the_survivors_into_the_first_slots(live, start):
    start = min(start, len(live))
    survivors = [i for i in range(start, len(live)) if live[i]]
    repack, holes = plan_repack(live, start), plan_hole_filling(live, start)
    for moves in (repack, holes):
        after = apply(list(range(len(live))), moves)
        assert after[:start] == list(range(start))  # nothing before start moves
        assert sorted(after[start : start + len(survivors)]) == survivors
        assert all(start <= s < len(live) and start <= d for s, d in moves)
    assert apply(list(range(len(live))), repack)[start : start + len(survivors)] == survivors
    assert {d for _, d in holes}.isdisjoint(s for s, _ in holes)  # holes are dead: no overlap
    assert len(holes) <= len(repack)


def apply_one_at_a_time(slots: list, moves) -> list:
    """Apply (src, dst) moves as a loop of single copies, each reading the slots as they are."""
    out = list(slots)
    for s, d in moves:
        out[d] = out[s]
    return out


@settings(max_examples=200, deadline=None)
@given(live=st.lists(st.booleans(), max_size=64), start=st.integers(0, 64))
def test_repack_destinations_are_only_earlier_moves_sources(live, start):
    """So one copy at a time front to back equals the gather-then-scatter; back to front does not
    whenever a destination is some move's source."""
    moves = plan_repack(live, min(start, len(live)))
    sources = [s for s, _ in moves]
    for j, (s, d) in enumerate(moves):
        assert d < s and d not in sources[j:]  # never a source still to be read
    slots = list(range(len(live)))
    assert apply_one_at_a_time(slots, moves) == apply(slots, moves)
    reverse = apply_one_at_a_time(slots, moves[::-1]) == apply(slots, moves)
    assert reverse == (not {d for _, d in moves} & set(sources))


def test_plans_reject_a_bad_start():
    with pytest.raises(ValueError, match="start: expected an int in \\[0, 3\\]"):
        plan_repack([True, False, True], 4)
    with pytest.raises(ValueError, match="block_size"):
        freeable_blocks([True], 0)


# --- the allocator's half -------------------------------------------------------------------------


def manager_with(num_tokens: int, block_size: int = 4, prefix_caching: bool = True):
    manager = BlockManager(BlockPool(16, block_size, enable_prefix_caching=prefix_caching))
    manager.allocate("a", list(range(100, 100 + num_tokens)))
    return manager


def test_move_slots_updates_the_table_hashes_and_allocator():
    manager = manager_with(24)
    table = list(manager.block_tables["a"])
    assert len(manager.pool.cached_blocks) == 6
    live = [t not in (2, 9, 13, 21) for t in range(24)]
    freed = manager.move_slots("a", plan_hole_filling(live), 20)
    assert freed == [table[5]] and manager.block_tables["a"] == table[:5]
    assert manager.token_ids["a"][2] == 123 and manager.num_tokens("a") == 20
    # blocks 0, 2, 3 were written and the chain breaks at block 0: no hash survives
    assert manager.block_hashes["a"] == [] and manager.pool.cached_blocks == {}
    manager.check_invariants()


def test_an_evicting_sequence_hashes_no_new_blocks():
    manager = manager_with(7)
    manager.stop_hashing("a")
    manager.append_slot("a", 107)  # fills block 1
    assert len(manager.block_hashes["a"]) == 1  # only the block hashed before the eviction
    manager.fork("a", "b")
    assert "b" in manager.unhashed
    manager.check_invariants()


def test_shared_blocks_are_never_written():
    manager = manager_with(8)
    manager.fork("a", "b")
    with pytest.raises(ValueError, match="which 2 sequences hold"):
        manager.move_slots("a", [(7, 1)], 7)
    with pytest.raises(ValueError, match="num_slots: expected an int in \\[1, 8\\]"):
        manager.move_slots("a", [], 9)


def test_drop_blocks_frees_a_block_with_no_survivor():
    manager = manager_with(12, prefix_caching=False)
    table = list(manager.block_tables["a"])
    assert manager.drop_blocks("a", [1]) == [table[1]]
    assert manager.block_tables["a"] == [table[0], table[2]] and manager.num_tokens("a") == 8
    assert manager.pool.num_free_blocks == 16 - 2
    with pytest.raises(ValueError, match="indices: expected block indices in \\[0, 2\\)"):
        manager.drop_blocks("a", [2])
    manager.check_invariants()


def test_slot_map_move():
    slot_map = SlotMap.empty()
    slot_map.append(torch.arange(6))
    slot_map.positions[[1, 3]] = -1
    moved = slot_map.move(plan_hole_filling(slot_map.live.tolist()), 4)
    assert moved.positions.tolist() == [0, 5, 2, 4]


# --- the cache ------------------------------------------------------------------------------------


def prompts(vocab: int, batch: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


class CheckedCache(CompactingPagedCache):
    """Checks every invariant after every pass and every release of empty blocks."""

    def compact(self, strategy):
        report = super().compact(strategy)
        self.check_invariants()
        return report

    def release_empty_blocks(self):
        report = super().release_empty_blocks()
        self.check_invariants()
        return report


def run(model, ids, new_tokens, made=None, **options):
    """Generate through a CompactingPagedCache whose invariants are checked after every pass; the
    cache is appended to `made`."""

    def factory(model, batch_size, max_seq_len):
        cache = CheckedCache.for_model(model, batch_size, max_seq_len, **options)
        if made is not None:
            made.append(cache)
        return cache

    return generate(model, ids, new_tokens, cache=factory)


def test_without_eviction_it_is_the_dense_cache(course_model):
    ids = prompts(course_model.config.vocab_size)
    dense = generate(course_model, ids, 20, cache="dynamic")
    assert torch.equal(run(course_model, ids, 20, block_size=4), dense)
    assert torch.equal(
        run(course_model, ids, 20, block_size=4, rotate_on_read=True), dense
    )  # rotated on read at the map's positions: the same tokens


POLICIES = {
    "H2O": lambda: H2O(),
    "StreamingLLM": lambda: StreamingLLM(),
    "TOVA": lambda: TOVA(),
    "random": lambda: RandomEviction(3),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_compacted_generation_is_token_identical(course_model, policy, block_size):
    """Every strategy and cadence (repeated rounds) against no compaction, same survivors."""
    ids = prompts(course_model.config.vocab_size)
    runs = {}
    for strategy, every in [(None, None), ("repack", 1), ("repack", 7), ("hole_filling", 1),
                            ("hole_filling", 7)]:  # fmt: skip
        made = []
        runs[strategy, every] = run(
            course_model, ids, 50, made, block_size=block_size, policy=POLICIES[policy](),
            budget=24, strategy=strategy, compact_every=every,
        )  # fmt: skip
        cache = made[0]
        cache.check_invariants()
        assert cache.num_tokens_held == 2 * 24
        if strategy is not None:
            assert cache.num_blocks_in_use <= made[0].manager.pool.num_blocks
    reference = runs[None, None]
    for key, tokens in runs.items():
        assert torch.equal(tokens, reference), key


def test_scattered_eviction_needs_compaction_to_free_blocks(course_model):
    """H2O at budget 24 of 90 tokens, blocks of 4: compaction ends holding at most
    ceil(24 / 4) + 1 blocks per sequence (the + 1: tokens appended since the last pass)."""
    ids = prompts(course_model.config.vocab_size)
    held = {}
    for strategy in (None, "repack", "hole_filling"):
        made = []
        run(course_model, ids, 50, made, block_size=4, policy=H2O(), budget=24,
            strategy=strategy, compact_every=1 if strategy else None)  # fmt: skip
        held[strategy] = made[0].num_blocks_in_use
        copies = sum(r.slots_copied for r in made[0].reports)
        assert (copies > 0) == (strategy is not None)
    assert held["repack"] == held["hole_filling"] <= 2 * (6 + 1) < held[None]


@torch.no_grad()
def test_dead_slots_never_take_part_in_attention(course_model):
    """Poison every evicted slot's K/V with NaN: the next logits are unchanged (and finite)."""
    ids = prompts(course_model.config.vocab_size, batch=1, length=30)
    cache = CompactingPagedCache.for_model(course_model, 1, 40, block_size=4)
    course_model(ids, cache=cache)
    cache.evict(0, [1, 5, 6, 7, 20])
    step = torch.tensor([[7]])
    before = course_model(step, cache=copy.deepcopy(cache))
    slot_map, table = cache.slot_maps[0], cache.manager.block_tables[0]
    dead = (~slot_map.live).nonzero()[:, 0]
    pool_slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in dead.tolist()])
    for layer in cache.key_cache + cache.value_cache:
        layer.flatten(0, 1)[pool_slots] = float("nan")
    after = course_model(step, cache=cache)
    assert torch.isfinite(after).all() and torch.equal(before, after)


def test_forked_samples_share_blocks_that_compaction_leaves_in_place(course_model):
    """Parallel samples share the prompt's blocks: a pass skips them (blocks_pinned) and the
    samples' tokens equal those of the uncompacted cache."""
    ids = prompts(course_model.config.vocab_size, batch=1, length=40)
    outs, made = [], []
    for strategy in (None, "hole_filling"):
        generator = torch.Generator().manual_seed(0)
        factory = CompactingPagedCache.factory(
            block_size=4, policy=StreamingLLM(), budget=32, strategy=strategy,
            compact_every=3 if strategy else None,
        )  # fmt: skip

        def keep(model, b, n, factory=factory):
            made.append(factory(model, b, n))
            return made[-1]

        outs.append(generate(course_model, ids, 30, cache=keep, num_samples=2, temperature=1.0,
                             generator=generator))  # fmt: skip
    assert torch.equal(*outs)
    assert any(r.blocks_pinned > 0 for r in made[1].reports if r.strategy == "hole_filling")


@torch.no_grad()
def test_positions_come_from_the_map_not_the_slot_order(course_model):
    """With keys rotated on read, hole-filling is harmless as long as RoPE reads the position
    map; rotating at the physical slot index instead changes the output."""

    class PhysicalOrder(CompactingPagedCache):
        def rope_positions(self):
            return self._read.slot_index  # the pitfall: where the token sits, not where it was

    ids = prompts(course_model.config.vocab_size, batch=1, length=30)
    logits = []
    for cls in (CompactingPagedCache, PhysicalOrder):
        cache = cls.for_model(course_model, 1, 40, block_size=4, rotate_on_read=True)
        course_model(ids, cache=cache)
        cache.evict(0, [2, 9, 13])
        report = cache.compact("hole_filling")
        assert report.slots_copied == 3 and report.blocks_freed == 1  # 30 -> 27 tokens
        assert cache.slot_maps[0].positions[[2, 9, 13]].tolist() == [29, 28, 27]
        logits.append(course_model(torch.tensor([[5]]), cache=cache))
    reference = CompactingPagedCache.for_model(course_model, 1, 40, block_size=4)
    course_model(ids, cache=reference)
    reference.evict(0, [2, 9, 13])
    expected = course_model(torch.tensor([[5]]), cache=reference)
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
    assert (logits[1] - expected).abs().max() > 0.1


def test_generation_on_smollm2_is_token_identical(smollm2):
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode("The paged KV cache frees a block only when")])
    runs = [
        run(
            model,
            ids,
            30,
            block_size=4,
            policy=H2O(),
            budget=16,
            strategy=strategy,
            compact_every=every,
        )  # fmt: skip
        for strategy, every in [(None, None), ("repack", 5), ("hole_filling", 1)]
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@torch.no_grad()
def test_named_errors(course_model):
    with pytest.raises(UnsupportedConfigError, match="SnapKV"):
        CompactingPagedCache.for_model(course_model, 1, 8, policy=SnapKV(), budget=64)
    with pytest.raises(ValueError, match="strategy: expected one of"):
        CompactingPagedCache.for_model(course_model, 1, 8, strategy="defrag")
    with pytest.raises(ValueError, match="compact_every: set a strategy"):
        CompactingPagedCache.for_model(course_model, 1, 8, compact_every=4)
    with pytest.raises(ValueError, match="budget: a policy needs a budget"):
        CompactingPagedCache.for_model(course_model, 1, 8, policy=H2O())
    cache = CompactingPagedCache.for_model(course_model, 2, 8, block_size=4)
    with pytest.raises(ValueError, match="does not support padding"):
        course_model(torch.ones(2, 3, dtype=torch.long), cache=cache,
                      attention_mask=torch.tensor([[1, 1, 1], [0, 1, 1]]))  # fmt: skip
    course_model(torch.ones(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="positions: sequence 1 holds no token at \\[5\\]"):
        cache.evict(1, [0, 5])
    with pytest.raises(ValueError, match="seq: expected an int in \\[0, 2\\)"):
        cache.evict(2, [0])
