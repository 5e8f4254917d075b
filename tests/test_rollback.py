"""Rolling a cache back (`truncate`, speculative decoding's rollback of rejected draft tokens):
after a rollback each cache kind holds, bitwise, what a cache that never saw the rolled-back
tokens holds, and its blocks return to the pool with none leaked (speculative decoding itself:
tests/test_speculative.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.cache import DynamicCache, PagedCache, StaticCache
from kvlib.cache.compaction import CompactingPagedCache
from kvlib.cache.evicting import EvictingCache
from kvlib.cache.eviction_policies import StreamingLLM
from kvlib.cache.latent import LatentCache
from kvlib.cache.paged_bounds import PageBoundsCache
from kvlib.cache.quantized import QuantizedCache, QuantizedPagedCache
from kvlib.quant import QuantScheme

LAYERS, HEADS, DIM = 2, 2, 8
INT8 = QuantScheme("int8", reduce="channels")


def make(kind: str, batch: int, block_size: int):
    paged = {"num_blocks": 64, "block_size": block_size}
    return {
        "dynamic": lambda: DynamicCache(LAYERS),
        "static": lambda: StaticCache(LAYERS, batch, HEADS, 64, DIM),
        "latent": lambda: LatentCache(LAYERS),
        "paged": lambda: PagedCache(LAYERS, HEADS, DIM, **paged),
        "bounds": lambda: PageBoundsCache(LAYERS, HEADS, DIM, **paged),
        "quantized-paged": lambda: QuantizedPagedCache(
            LAYERS, HEADS, DIM, key_scheme=INT8, **paged
        ),
    }[kind]()


def write(cache, kind: str, k: torch.Tensor, v: torch.Tensor) -> None:
    """One forward's writes: every layer's K/V (B, H_kv, T, D), then advance."""
    for layer in range(LAYERS):
        if kind == "latent":  # MLA: a latent (B, 1, T, d_c) and a rotary key (B, 1, T, d_R)
            cache.update(layer, k[:, :1] + layer, v[:, :1, :, :4])
        else:
            cache.update(layer, k + layer, v - layer)
    cache.advance(k.shape[2])


def contents(cache, kind: str) -> list[torch.Tensor]:
    """What attention can read, per layer: dense K/V, or each sequence's blocks in logical order
    in every pool (keys, values, codes, scales, a block's bounds): block ids may differ."""
    if kind in ("dynamic", "latent"):
        return [t for t in cache.keys + cache.values if t is not None]
    if kind == "static":
        return [cache.buffer]
    tables = cache.manager.block_tables
    blocks = [b for seq in sorted(tables) for b in tables[seq]]
    return [pool[blocks] for pool in cache._pools()]


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    kind=st.sampled_from(["dynamic", "static", "latent", "paged", "bounds", "quantized-paged"]),
    batch=st.integers(1, 3),
    block_size=st.sampled_from([1, 2, 4, 8]),
    prompt=st.integers(1, 12),
    draft=st.integers(0, 6),
    data=st.data(),
)
def test_a_rollback_leaves_what_a_cache_that_never_saw_the_draft_holds(
    kind, batch, block_size, prompt, draft, data
):
    """Prompt, then k + 1 verified tokens in one forward, of which `accepted` are kept, then one
    more step: bitwise equal to the cache that saw prompt, the accepted tokens and the step."""
    accepted = data.draw(st.integers(0, draft + 1))
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    total = prompt + draft + 1 + 1
    k, v = torch.randn(2, batch, HEADS, total, DIM, generator=g).unbind(0)
    spans = [(0, prompt), (prompt, prompt + draft + 1)]
    rolled, fresh = make(kind, batch, block_size), make(kind, batch, block_size)
    for start, end in spans:
        write(rolled, kind, k[:, :, start:end], v[:, :, start:end])
    rolled.truncate(prompt + accepted)
    write(fresh, kind, k[:, :, :prompt], v[:, :, :prompt])
    if accepted:
        write(fresh, kind, k[:, :, prompt : prompt + accepted], v[:, :, prompt : prompt + accepted])
    assert rolled.length == fresh.length == prompt + accepted
    for cache in (rolled, fresh):  # the next step (its own K/V, the same for both)
        write(cache, kind, k[:, :, -1:], v[:, :, -1:])
    assert torch.equal(rolled.seq_lens, fresh.seq_lens)
    for a, b in zip(contents(rolled, kind), contents(fresh, kind), strict=True):
        assert torch.equal(a, b)
    if kind in ("paged", "bounds", "quantized-paged"):
        rolled.manager.check_invariants()
        assert rolled.num_blocks_in_use == fresh.num_blocks_in_use  # no block leaked


def test_a_rollback_to_nothing_frees_every_block_and_bad_lengths_are_named():
    cache = make("paged", 2, 4)
    k = torch.randn(2, HEADS, 9, DIM)
    write(cache, "paged", k, k)
    assert cache.num_blocks_in_use == 6
    for bad in (10, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"length: expected an int in \[0, 9\]"):
            cache.truncate(bad)
    assert cache.num_blocks_in_use == 6  # nothing changed
    cache.truncate(0)
    assert cache.num_blocks_in_use == 0 and cache.length == 0


def test_a_rollback_inside_a_shared_block_copies_it_and_leaves_the_sibling_intact():
    """Parallel samples share the prompt's blocks; both roll back into the shared partial block:
    the first gets its own copy (copy-on-write), the second then holds the original alone, and
    both still read the tokens they keep; the full block stays shared."""
    cache = make("paged", 1, 4)
    k = torch.randn(1, HEADS, 6, DIM)
    write(cache, "paged", k, -k)  # 6 tokens: block 0 full, block 1 holds 2
    cache = cache.repeat(2)
    full, partial = cache.manager.block_tables[0]
    cache.truncate(5)
    tables = cache.manager.block_tables
    assert tables[0][0] == tables[1][0] == full and cache.manager.pool.blocks[full].ref_cnt == 2
    assert tables[0][1] != partial and tables[1][1] == partial  # the first copied, the second not
    cache.manager.check_invariants()
    for seq in (0, 1):
        slots = [tables[seq][t // 4] * 4 + t % 4 for t in range(5)]
        stored = cache.key_cache[0].flatten(0, 1)[slots]  # (5, H_kv, D)
        assert torch.equal(stored, k[0, :, :5].transpose(0, 1))
        assert not cache.key_cache[0][tables[seq][1], 1:].any()  # the dropped slot zeroed


KIVI_SCHEMES = {  # (keys, values): per-token int8; KIVI's per-channel keys in groups of G tokens
    "int8": (INT8, INT8),
    "kivi G=2": (
        QuantScheme("int4", False, "tokens", 2),
        QuantScheme("int4", False, "channels", 4),
    ),
    "kivi G=4": (
        QuantScheme("int2", False, "tokens", 4),
        QuantScheme("int4", False, "channels", 4),
    ),
    "per-channel both": (
        QuantScheme("int4", False, "tokens", 3),
        QuantScheme("int8", True, "tokens", 2),
    ),
}


def quantized_contents(cache: QuantizedCache) -> list:
    """Every layer's history (shape, codes, scales, zero points) and residuals; None as None."""
    out = []
    for q in cache.keys + cache.values:
        out += [None] if q is None else [q.shape, q.codes, q.scale, q.zero]
    return out + cache.residual_keys + cache.residual_values


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x is y if x is None or y is None else x == y if isinstance(x, tuple) else torch.equal(x, y)
        for x, y in zip(a, b)
    )


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    schemes=st.sampled_from(sorted(KIVI_SCHEMES)),
    residual=st.sampled_from([0, 1, 2, 3, 5, 8]),
    prompt=st.integers(1, 12),
    draft=st.integers(0, 6),
    data=st.data(),
)
def test_a_quantized_cache_rolls_back_exactly_or_refuses_and_stays_as_it_was(
    schemes, residual, prompt, draft, data
):
    """The same scenario over `QuantizedCache` (KIVI): the rollback is allowed exactly when every
    position the never-saw cache holds in full precision is still in full precision (that cache's
    history, H tokens: none of H..length - 1 quantized in the rolled-back one), and then leaves
    that cache bitwise, next step included; otherwise it raises, naming the length, and leaves
    the cache as it was."""
    accepted = data.draw(st.integers(0, draft + 1))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    length, total = prompt + accepted, prompt + draft + 1
    k, v = torch.randn(2, 2, HEADS, total + 1, DIM, generator=g).unbind(0)
    rolled, fresh = (
        QuantizedCache(LAYERS, *KIVI_SCHEMES[schemes], residual_length=residual) for _ in "ab"
    )
    for start, end in ((0, prompt), (prompt, total)):
        write(rolled, "quantized", k[:, :, start:end], v[:, :, start:end])
    for start, end in ((0, prompt), (prompt, length)):
        if end > start:
            write(fresh, "quantized", k[:, :, start:end], v[:, :, start:end])
    exact = all(
        (0 if mine is None else mine.num_tokens) <= held or held == length
        for mine, never in zip(rolled.keys + rolled.values, fresh.keys + fresh.values)
        for held in [0 if never is None else never.num_tokens]
    )
    before = quantized_contents(rolled)
    if not exact:
        with pytest.raises(
            NotImplementedError, match=f"cannot roll back to length {length}: a flush"
        ):
            rolled.truncate(length)
        assert rolled.length == total and same(quantized_contents(rolled), before)
        return
    rolled.truncate(length)
    assert rolled.length == fresh.length == length
    for cache in (rolled, fresh):
        write(cache, "quantized", k[:, :, -1:], v[:, :, -1:])
    assert same(quantized_contents(rolled), quantized_contents(fresh))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    schemes=st.sampled_from(sorted(KIVI_SCHEMES)),
    residual=st.sampled_from([0, 1, 3, 5]),
    writes=st.lists(st.integers(1, 7), min_size=1, max_size=6),
)
def test_how_many_tokens_are_quantized_depends_on_the_length_alone(schemes, residual, writes):
    """However the writes are split, after L tokens keys and values each hold Q(L) = max(0,
    (L - R) // unit * unit) quantized (unit: 1 per token, G per channel): the fact the rollback
    rule rests on."""
    cache = QuantizedCache(LAYERS, *KIVI_SCHEMES[schemes], residual_length=residual)
    for n in writes:
        write(cache, "quantized", torch.randn(1, HEADS, n, DIM), torch.randn(1, HEADS, n, DIM))
        for store, scheme in (
            (cache.keys, KIVI_SCHEMES[schemes][0]),
            (cache.values, KIVI_SCHEMES[schemes][1]),
        ):
            unit = scheme.group_size if scheme.reduce == "tokens" else 1
            quantized = max(0, (cache.length - residual) // unit * unit)
            assert all((0 if q is None else q.num_tokens) == quantized for q in store)


def test_kivi_rolls_back_inside_its_residual_and_refuses_across_a_flush():
    """Per-channel keys and values (groups of G = 4) with R = 2: 5 tokens, then 4 more in one
    write (length 9 passes the flush point R + G = 6: positions 0..3 quantized). Back to 6 or
    more: exact; back to 5: positions 0..3 quantized that a cache of 5 tokens holds in full
    precision: refused. `KeyFlushUnitCache`'s per-token keys flushed 4 at a time follow the same
    rule; at R = 0 per-token rollbacks are always exact (the history is cut); `requantize_history`
    refuses."""
    keys = KIVI_SCHEMES["kivi G=4"][0]
    cache = QuantizedCache(LAYERS, keys, keys, residual_length=2)
    k = torch.randn(1, HEADS, 9, DIM)
    write(cache, "quantized", k[:, :, :5], k[:, :, :5])
    write(cache, "quantized", k[:, :, 5:], k[:, :, 5:])
    with pytest.raises(
        NotImplementedError,
        match=r"QuantizedCache cannot roll back to length 5: a flush since then quantized the keys "
        r"of positions 0\.\.3, which a cache that never saw positions 5\.\.8 holds in full",
    ):
        cache.truncate(5)
    cache.truncate(6)
    assert cache.keys[0].num_tokens == 4 and cache.residual_keys[0].shape[2] == 2
    assert cache.values[0].num_tokens == 4 and cache.residual_values[0].shape[2] == 2
    from kvlib.experiments.quant_flush_unit import KeyFlushUnitCache

    held_back = KeyFlushUnitCache(LAYERS, INT8, keys, key_flush_unit=4, residual_length=2)
    for cut in ((0, 5), (5, 9)):  # per-token keys flushed 4 at a time: the same rule
        write(held_back, "quantized", k[:, :, slice(*cut)], k[:, :, slice(*cut)])
    with pytest.raises(
        NotImplementedError, match=r"KeyFlushUnitCache .* keys of positions 0\.\.3,"
    ):
        held_back.truncate(5)
    held_back.truncate(6)
    per_token = QuantizedCache(LAYERS, INT8, residual_length=0)
    write(per_token, "quantized", k, k)
    per_token.truncate(3)
    assert per_token.keys[1].num_tokens == 3 and per_token.residual_keys[1].shape[2] == 0
    requantizing = QuantizedCache(LAYERS, INT8, residual_length=4, requantize_history=True)
    with pytest.raises(
        NotImplementedError, match="QuantizedCache does not roll back: with requantize_history=True"
    ):
        requantizing.truncate(0)


def test_caches_that_cannot_roll_back_say_why():
    evicting = EvictingCache(LAYERS, StreamingLLM(num_sinks=1), budget=8)
    with pytest.raises(NotImplementedError, match="evicts after every forward"):
        evicting.truncate(0)
    compacting = CompactingPagedCache(
        LAYERS, HEADS, DIM, num_blocks=8, policy=StreamingLLM(num_sinks=1), budget=8
    )
    with pytest.raises(NotImplementedError, match="evicted or compacted tokens"):
        compacting.truncate(0)


def test_a_rollback_that_cannot_copy_leaves_the_cache_as_it_was():
    """Three samples share a partial block and one block is free: rolling all three back into it
    needs two copies; the rollback raises before changing any sequence or any K/V."""
    from kvlib.errors import OutOfBlocksError

    cache = PagedCache(LAYERS, HEADS, DIM, num_blocks=3, block_size=4)
    k = torch.randn(1, HEADS, 6, DIM)
    write(cache, "paged", k, k)  # 2 blocks, the second partial
    cache = cache.repeat(3)
    before = ([list(t) for t in cache.manager.block_tables.values()], cache.key_cache[0].clone())
    with pytest.raises(OutOfBlocksError):
        cache.truncate(5)
    assert cache.length == 6 and cache.seq_lens.tolist() == [6, 6, 6]
    assert [list(t) for t in cache.manager.block_tables.values()] == before[0]
    assert torch.equal(cache.key_cache[0], before[1])
    cache.manager.check_invariants()


def test_moving_tokens_checks_every_sequence_before_moving_any():
    cache = make("paged", 2, 4)
    k = torch.randn(2, HEADS, 5, DIM)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0  # sequence 1 is left-padded
    for layer in range(LAYERS):
        if layer == 0:
            cache.begin_forward(5, mask)
        cache.update(layer, k, k)
    cache.advance(5)
    before = cache.key_cache[0].clone()
    with pytest.raises(ValueError, match="sequence 1 has padding"):
        cache.move_tokens([3], [2])
    assert torch.equal(cache.key_cache[0], before)


def test_a_rollback_to_nothing_leaves_a_cache_as_new():
    cache = make("paged", 1, 4)
    write(cache, "paged", torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM))
    cache.truncate(0)
    write(cache, "paged", torch.randn(2, HEADS, 3, DIM), torch.randn(2, HEADS, 3, DIM))  # batch 2
    assert cache.seq_lens.tolist() == [3, 3]
