"""Paged sliding windows (`kvlib.cache.paged_window`, chapter 17) against their oracles:

1. the freeable blocks are exactly those no query at position >= n can see, by brute force over
   positions and queries with `kvlib.ops.attention.visible` (every n <= 40, W <= 12, block sizes
   1-5, sinks 0-5: n = W, W +- 1 and W not a multiple of the block size included);
2. freeing raises the pool's free count by the blocks given back, never frees a live block, and
   keeps the allocator's invariants (`BlockManager.check_invariants`) after every step;
3. decode attention over the K/V still held, gathered through the block table, equals dense
   attention under the window mask (`reference_attention`), with every free block of the pool
   overwritten by NaN before each read (a read of freed memory would show);
4. the course model with `sliding_window` over `PagedWindowCache` is token for token the ring
   buffer (`RingCache`) and the dense cache, its logits the full forward's, while its blocks in
   use stop growing;
5. the pitfall: a block a prefix hit shares with another sequence loses only this sequence's
   reference when the window passes it; a freeing that ignores the reference count hands the
   other sequence's K/V to a new allocation.

Tolerances: the gathered and the dense attention add the same non-zero terms (masked ones are
exact zeros) in float64: 1e-12. Model logits in float32: 1e-4, as tests/test_ring_cache.py.
"""

import dataclasses

import pytest
import torch

from kvlib.cache import DynamicCache, RingCache
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool
from kvlib.cache.paged import PagedKV, read_slots
from kvlib.cache.paged_window import (
    LiveBlocks,
    PagedWindowCache,
    free_window_blocks,
    freeable_blocks,
    live_block_range,
)
from kvlib.generation import generate
from kvlib.loaders.course_model import load_course_model
from kvlib.model import LlamaModel
from kvlib.ops.attention import reference_attention, visible
from kvlib.testing import assert_close

W = 8
FLOAT32 = {"rtol": 1e-4, "atol": 1e-4}
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


def sees(key_positions, query_positions, window, sink_tokens):
    """The oracle's rule: causal, and inside the window or among the first `sink_tokens`."""
    in_window = visible(key_positions, query_positions, window)
    return in_window | ((key_positions < sink_tokens) & (key_positions <= query_positions))


def brute_force_dead_blocks(num_positions, window, block_size, sink_tokens):
    """Blocks of a sequence of n tokens no query at n, n + 1, ... sees at any of their positions
    (queries up to n + W + block_size: a future position j is seen by the query at j <= that)."""
    num_blocks = -(-num_positions // block_size)
    keys = torch.arange(num_blocks * block_size)  # every position the blocks cover
    queries = torch.arange(num_positions, num_positions + window + block_size + 1)
    seen = sees(keys[None, :], queries[:, None], window, sink_tokens).any(dim=0)  # (P,)
    alive = seen.view(num_blocks, block_size).any(dim=1)
    return [i for i in range(num_blocks) if not alive[i]]


def test_freeable_blocks_are_exactly_those_outside_every_window_by_brute_force():
    checked = set()
    for block_size in range(1, 6):
        for window in range(1, 13):
            for sink_tokens in range(0, 6):
                for n in range(0, 41):
                    expected = brute_force_dead_blocks(n, window, block_size, sink_tokens)
                    got = freeable_blocks(n, window, block_size, sink_tokens)
                    assert got == expected, (n, window, block_size, sink_tokens, got, expected)
                    live = live_block_range(n, window, block_size, sink_tokens)
                    held = set(live.sinks) | set(live.window)
                    assert held == set(range(-(-n // block_size))) - set(got)
                    checked.add((n - window, window % block_size == 0))
    assert {(0, True), (0, False), (-1, False), (1, False), (1, True)} <= checked


@pytest.mark.parametrize(
    "args, live, freeable",
    [
        ((8, 8, 4), LiveBlocks(range(0), range(0, 2)), []),  # n = W: position 0 dead, no block
        ((11, 8, 4), LiveBlocks(range(0), range(1, 3)), [0]),  # positions 0..3 dead
        ((12, 8, 4), LiveBlocks(range(0), range(1, 3)), [0]),  # position 4 is still seen
        ((13, 6, 4), LiveBlocks(range(0), range(2, 4)), [0, 1]),  # W not a multiple of 4
        ((13, 6, 4, 1), LiveBlocks(range(1), range(2, 4)), [1]),  # a sink keeps block 0
        ((13, 6, 4, 5), LiveBlocks(range(2), range(2, 4)), []),
        ((12, 1, 4), LiveBlocks(range(0), range(3, 3)), [0, 1, 2]),  # W = 1: only itself
        ((0, 3, 4), LiveBlocks(range(0), range(0, 0)), []),
    ],
)
def test_worked_examples(args, live, freeable):
    assert live_block_range(*args) == live
    assert freeable_blocks(*args) == freeable


def test_arguments_are_validated_by_name():
    with pytest.raises(ValueError, match="window: expected an int >= 1, got 0"):
        freeable_blocks(4, 0, 4)
    with pytest.raises(ValueError, match="num_positions: expected an int >= 0, got -1"):
        live_block_range(-1, 4, 4)
    with pytest.raises(ValueError, match="block_size: expected an int >= 1, got 0"):
        freeable_blocks(4, 4, 0)
    with pytest.raises(ValueError, match="sink_tokens: expected an int >= 0, got -2"):
        freeable_blocks(4, 4, 4, sink_tokens=-2)
    with pytest.raises(TypeError, match="window: expected an int, got float 2.5"):
        freeable_blocks(4, 2.5, 4)
    with pytest.raises(TypeError, match="num_positions: expected an int, got bool"):
        freeable_blocks(True, 2, 4)
    with pytest.raises(KeyError):
        free_window_blocks(BlockManager(BlockPool(4, 2)), "nobody", 2)


def decode(
    window, block_size, sink_tokens, num_tokens, *, seed=0, num_blocks=None, reserve_null_block=True
):
    """Decode `num_tokens` random K/V one at a time into a paged pool, freeing after each step;
    yield (manager, pools, keys, values, position) after each token is written, before the free.
    pools: (key_pool, value_pool) (num_blocks, block_size, H_kv, D) float64; keys, values: the
    dense (1, H_kv, num_tokens, D) oracle."""
    generator = torch.Generator().manual_seed(seed)
    h_kv, d = 2, 8
    num_blocks = num_blocks or num_tokens // block_size + 4
    manager = BlockManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False))
    pools = [torch.zeros(num_blocks, block_size, h_kv, d, dtype=torch.float64) for _ in "kv"]
    keys, values = (
        torch.randn(1, h_kv, num_tokens, d, generator=generator, dtype=torch.float64) for _ in "kv"
    )
    if reserve_null_block:  # first, as `PagedWindowCache` does: a fresh pool's zeros
        manager.reserve_null_block()
    manager.allocate("a", [0])
    for position in range(num_tokens):
        slot = manager.slot("a", 0) if position == 0 else manager.append_slot("a", 0)
        for pool, new in zip(pools, (keys, values)):
            pool.view(-1, h_kv, d)[slot] = new[0, :, position]  # (H_kv, D) at its slot
        yield manager, pools, keys, values, position


@pytest.mark.parametrize(
    "window, block_size, sink_tokens",
    [(8, 4, 0), (6, 4, 0), (7, 3, 2), (1, 2, 0), (5, 1, 1), (9, 4, 4)],
)
def test_freeing_raises_the_free_count_and_never_frees_a_live_block(
    window, block_size, sink_tokens
):
    steps = decode(window, block_size, sink_tokens, 40, reserve_null_block=False)
    for manager, _, _, _, position in steps:
        pool = manager.pool
        pool_free_before = pool.num_free_blocks
        first_use = manager.null_block is None  # the first freeing reserves the null block
        freed = free_window_blocks(manager, "a", window, sink_tokens=sink_tokens)
        manager.check_invariants()
        gained = len(freed) - (1 if first_use and freed else 0)
        assert pool.num_free_blocks == pool_free_before + gained, position
        n = position + 1
        table = manager.block_tables["a"]
        live = live_block_range(n, window, block_size, sink_tokens)
        for i in set(live.sinks) | set(live.window):  # live: held, not the null block
            assert table[i] != manager.null_block and pool.blocks[table[i]].ref_cnt == 1
            assert table[i] not in pool.free_queue
        dead = freeable_blocks(n, window, block_size, sink_tokens)
        assert all(table[i] == manager.null_block for i in dead)
        assert free_window_blocks(manager, "a", window, sink_tokens=sink_tokens) == []
        held = len(set(table) - {manager.null_block})
        bound = -(-(window - 1) // block_size) + 1 + -(-sink_tokens // block_size)
        assert held <= bound, f"{held} blocks held after {n} tokens; the window needs {bound}"


def window_attention_through_table(q, manager, pools, position, window, sink_tokens):
    """The decode query at `position` over the positions it sees, each read at its slot
    (`manager.slot`: table[p // block_size] * block_size + p % block_size): (1, H, 1, D)."""
    seen = [p for p in range(position + 1) if sees(p, position, window, sink_tokens)]
    slots = torch.tensor([manager.slot("a", p) for p in seen])
    k, v = (pool.flatten(0, 1)[slots].permute(1, 0, 2)[None] for pool in pools)  # (1, H_kv, S, D)
    return reference_attention(q, (k, v), torch.ones(1, 1, len(seen), dtype=torch.bool))


@pytest.mark.parametrize(
    "window, block_size, sink_tokens",
    [(8, 4, 0), (6, 4, 0), (7, 3, 2), (1, 2, 0), (W, 16, 0), (5, 2, 3)],
)
def test_decode_attention_over_the_live_blocks_equals_dense_window_attention(
    window, block_size, sink_tokens
):
    generator = torch.Generator().manual_seed(1)
    for manager, pools, keys, values, position in decode(window, block_size, sink_tokens, 37):
        q = torch.randn(1, 4, 1, 8, generator=generator, dtype=torch.float64)  # (B, H, T, D)
        key_positions = torch.arange(position + 1)
        mask = sees(key_positions, torch.tensor(position), window, sink_tokens)  # (S,)
        dense = reference_attention(
            q, (keys[:, :, : position + 1], values[:, :, : position + 1]), mask.view(1, 1, -1)
        )  # (1, H, 1, D): GQA, 4 query heads over 2 KV heads
        paged = window_attention_through_table(q, manager, pools, position, window, sink_tokens)
        assert_close(paged, dense, name=f"live blocks at position {position}", **FLOAT64)
        # the paged reference's way: gather every position (the dead ones from the null block)
        # and mask them; the null block is zeros, finite, so masked reads add exact zeros
        table = torch.tensor(manager.block_tables["a"])[None]
        handle = PagedKV(*pools, table, torch.tensor([position + 1]))
        slots = read_slots(handle)  # (1, S)
        k, v = (pool.flatten(0, 1)[slots[0]].permute(1, 0, 2)[None] for pool in pools)
        gathered = reference_attention(q, (k, v), mask.view(1, 1, -1))
        assert_close(gathered, dense, name=f"whole table at position {position}", **FLOAT64)
        free_window_blocks(manager, "a", window, sink_tokens=sink_tokens)
        for pool in pools:  # scribble over every free block: nobody may read them now
            pool[list(manager.pool.free_queue)] = float("nan")


def test_a_null_block_holding_nan_poisons_the_masked_whole_table_read():
    """The null block's content must be finite: a masked read gives its keys weight exactly 0,
    and 0 · NaN is NaN. Reserved before any K/V is written (a fresh pool's zeros), it is; taken
    later from a pool of used blocks, it may not be. Reading only the live positions never
    touches it."""
    generator = torch.Generator().manual_seed(3)
    for state in decode(6, 4, 0, 20):  # 20 tokens decoded, freeing as they go
        free_window_blocks(state[0], "a", 6)
    manager, pools, keys, values, _ = state
    q = torch.randn(1, 4, 1, 8, generator=generator, dtype=torch.float64)
    for pool in pools:
        pool[manager.null_block] = float("nan")
    mask = visible(torch.arange(20), torch.tensor(19), 6).view(1, 1, -1)
    dense = reference_attention(q, (keys, values), mask)
    live = window_attention_through_table(q, manager, pools, 19, 6, 0)
    assert_close(live, dense, name="live positions only", **FLOAT64)
    slots = read_slots(
        PagedKV(*pools, torch.tensor([manager.block_tables["a"]]), torch.tensor([20]))
    )
    k, v = (pool.flatten(0, 1)[slots[0]].permute(1, 0, 2)[None] for pool in pools)
    assert reference_attention(q, (k, v), mask).isnan().all()


def test_every_freed_block_can_be_reused_by_another_sequence_at_once():
    """A window's freed blocks serve a new sequence, which overwrites them; the windowed
    sequence keeps decoding correctly (its attention never reads them)."""
    steps = decode(6, 4, 0, 40, num_blocks=6)  # 6 blocks: the window needs 3 plus the null block
    generator = torch.Generator().manual_seed(2)
    for manager, pools, keys, values, position in steps:
        q = torch.randn(1, 4, 1, 8, generator=generator, dtype=torch.float64)
        mask = visible(torch.arange(position + 1), torch.tensor(position), 6).view(1, 1, -1)
        dense = reference_attention(
            q, (keys[:, :, : position + 1], values[:, :, : position + 1]), mask
        )
        paged = window_attention_through_table(q, manager, pools, position, 6, 0)
        assert_close(paged, dense, name=f"position {position}", **FLOAT64)
        freed = free_window_blocks(manager, "a", 6)
        manager.allocate("other", [0] * (manager.pool.num_free_blocks * 4))  # every free block
        assert not set(freed) - set(manager.block_tables["other"]) - {manager.null_block}
        for block in manager.block_tables["other"]:
            for pool in pools:
                pool[block] = 1e30  # the other sequence's K/V
        manager.check_invariants()
        manager.free("other")  # its blocks go back, written: the next append may take one
    assert position == 39


def test_a_block_a_prefix_hit_shares_stays_with_the_other_sequence():
    """Sequences a and b share their prompt's first 3 blocks (b's prefix hit). a's window passes
    them: a gives back its references only; b still holds the blocks, whose K/V stay intact when
    the pool hands every free block to a third sequence that overwrites them."""
    block_size, window = 4, 4
    manager = BlockManager(BlockPool(12, block_size))  # prefix caching on
    prompt = list(range(13))
    manager.allocate("a", prompt)
    assert manager.allocate("b", prompt) == 12  # 3 full blocks from the prefix cache
    shared = manager.block_tables["b"][:3]
    kv = {p: float(p) for p in range(13)}  # each slot's content: its position (b's view)
    pool = torch.zeros(12, block_size)
    for p in range(13):
        pool.view(-1)[manager.slot("b", p)] = kv[p]
    for token in range(20, 30):  # a decodes 10 tokens: its window leaves the shared blocks
        manager.append_slot("a", token)
    free_before = manager.pool.num_free_blocks
    freed = free_window_blocks(manager, "a", window)
    manager.check_invariants()
    assert set(shared) <= set(freed)
    private = [block for block in freed if block not in shared]
    null_taken = 1  # the first call reserved the null block
    assert manager.pool.num_free_blocks == free_before + len(private) - null_taken
    assert all(manager.pool.blocks[block].ref_cnt == 1 for block in shared)  # b's references
    assert manager.block_tables["b"][:3] == shared
    manager.allocate("c", [99] * (manager.pool.num_free_blocks * block_size))
    for block in manager.block_tables["c"]:
        pool[block] = -1.0  # c writes its K/V
    b_reads = [pool.view(-1)[manager.slot("b", p)].item() for p in range(13)]
    assert b_reads == [kv[p] for p in range(13)], "b's prefix K/V was overwritten"
    manager.check_invariants()


def test_freeing_that_ignores_the_reference_count_corrupts_the_sharer():
    """The pitfall reproduced: returning a's dead blocks to the pool as if a held them alone
    (freeing each until its count is 0) frees b's prefix too; the next allocation takes it and
    overwrites b's K/V."""
    block_size, window = 4, 4
    manager = BlockManager(BlockPool(12, block_size))
    prompt = list(range(13))
    manager.allocate("a", prompt)
    manager.allocate("b", prompt)
    shared = manager.block_tables["b"][:3]
    pool = torch.zeros(12, block_size)
    for p in range(13):
        pool.view(-1)[manager.slot("b", p)] = float(p)
    for token in range(20, 30):
        manager.append_slot("a", token)
    table = manager.block_tables["a"]
    for i in freeable_blocks(manager.num_tokens("a"), window, block_size):  # the buggy freeing
        block = table[i]
        manager.pool.free([block] * manager.pool.blocks[block].ref_cnt)
    with pytest.raises(AssertionError, match="ref_cnt 0 but"):
        manager.check_invariants()  # b's table still names blocks the pool calls free
    taken = manager.pool.allocate(manager.pool.num_free_blocks)  # another sequence takes them
    assert set(shared) <= set(taken)
    for block in taken:
        pool[block] = -1.0  # ... and writes its K/V
    b_reads = [pool.view(-1)[manager.slot("b", p)].item() for p in range(12)]
    assert b_reads == [-1.0] * 12, "b now reads another sequence's K/V"


def test_a_freed_private_block_stays_in_the_prefix_cache_until_evicted():
    """A block freed to count 0 keeps its hash (its K/V is intact): a later prompt with the same
    prefix takes it back (chapter 7's prefix cache, unchanged)."""
    manager = BlockManager(BlockPool(16, 4))
    manager.allocate("a", list(range(9)))
    for token in range(20, 30):
        manager.append_slot("a", token)
    first = manager.block_tables["a"][0]
    assert first in free_window_blocks(manager, "a", 4)
    assert manager.allocate("d", list(range(9))) == 8  # both prompt blocks come back
    assert manager.block_tables["d"][0] == first
    manager.check_invariants()


# --- the course model over PagedWindowCache --------------------------------------------------


@pytest.fixture(scope="module")
def windowed():
    """The course model with `sliding_window = W` on a copy of its config (read only)."""
    base = load_course_model()
    model = LlamaModel(dataclasses.replace(base.config, sliding_window=W)).eval()
    model.load_state_dict(base.state_dict())
    return model


def token_ids(batch=2, length=21, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block_size", (1, 3, 4, 16))
@pytest.mark.parametrize("prefill_chunk_size", (None, 5))
def test_greedy_generation_is_token_for_token_the_ring_and_the_dense_cache(
    windowed, block_size, prefill_chunk_size
):
    prompts = token_ids(seed=block_size)
    kwargs = {"max_new_tokens": 3 * W, "prefill_chunk_size": prefill_chunk_size}
    dense = generate(windowed, prompts, cache="dynamic", **kwargs)
    ring = generate(windowed, prompts, cache=lambda m, b, s: RingCache.for_model(m), **kwargs)
    paged = generate(
        windowed, prompts, cache=PagedWindowCache.factory(block_size=block_size), **kwargs
    )
    assert torch.equal(paged, ring), f"first difference at {(paged != ring).nonzero()[:1]}"
    assert torch.equal(paged, dense)


@pytest.mark.parametrize("options", [{"num_beams": 3}, {"padded": True}])
def test_beams_and_ragged_batches_match_the_dense_cache(windowed, options):
    prompts = token_ids(batch=3, seed=7)
    kwargs = {"max_new_tokens": 2 * W}
    if options.pop("padded", False):
        mask = torch.ones_like(prompts)
        mask[1, :6], mask[2, :15] = 0, 0
        kwargs["attention_mask"] = mask
    kwargs.update(options)
    dense = generate(windowed, prompts, cache="dynamic", **kwargs)
    copies = options.get("num_beams", 1)
    factory = PagedWindowCache.factory(block_size=4, copies_per_sequence=copies)
    assert torch.equal(generate(windowed, prompts, cache=factory, **kwargs), dense)


@torch.no_grad()
def test_decode_logits_equal_the_full_forward_while_blocks_in_use_stop_growing(windowed):
    ids = token_ids(length=6 * W, seed=3)
    oracle = windowed(ids)  # (B, T, V): the model's own window mask, no cache
    cache = PagedWindowCache.for_model(windowed, 2, ids.shape[1], block_size=4)
    prompt = W + 1
    assert_close(
        windowed(ids[:, :prompt], cache=cache), oracle[:, :prompt], name="prefill", **FLOAT32
    )
    in_use = []
    for position in range(prompt, ids.shape[1]):
        step = windowed(ids[:, position : position + 1], cache=cache)[:, 0]
        assert_close(step, oracle[:, position], name=f"decode at {position}", **FLOAT32)
        live = live_block_range(position + 1, W, 4)
        assert cache.num_blocks_in_use == 1 + 2 * len(set(live.sinks) | set(live.window))
        cache.manager.check_invariants()
        in_use.append(cache.num_blocks_in_use)
    assert max(in_use) == 1 + 2 * 3  # the null block + 3 blocks a sequence, whatever the length
    assert cache.freed_blocks == 2 * (freeable_blocks(ids.shape[1], W, 4)[-1] + 1)
    dense = DynamicCache(4)
    windowed(ids, cache=dense)
    block_bytes = 4 * 2 * 4 * 4 * 32 * 4  # L · (K, V) · block_size · H_kv · D · float32
    assert cache.nbytes == cache.num_blocks_in_use * block_bytes <= 7 * block_bytes
    assert dense.nbytes == 4 * 2 * 2 * 4 * 6 * W * 32 * 4 == 48 // 4 * 2 * block_bytes


def test_refusals_name_the_argument(windowed):
    with pytest.raises(ValueError, match="window: expected the model's sliding_window \\(None"):
        PagedWindowCache.for_model(load_course_model(), 1, 16)
    with pytest.raises(ValueError, match="window: expected the model's sliding_window \\(8"):
        PagedWindowCache.for_model(windowed, 1, 16, window=5)
    with pytest.raises(ValueError, match="window: expected an int >= 1, got 0"):
        PagedWindowCache(1, 1, 4, num_blocks=4, block_size=2, window=0)
    cache = PagedWindowCache.for_model(windowed, 1, 16, block_size=4)
    windowed(token_ids(batch=1, length=3), cache=cache)
    with pytest.raises(NotImplementedError, match="PagedWindowCache does not roll back"):
        cache.truncate(1)
