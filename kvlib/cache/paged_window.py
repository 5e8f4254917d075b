"""Paged sliding windows (chapter 17): which blocks of chapter 7's paged cache a sliding-window
layer can give back, and giving them back.

With a window of W positions, the query at position p sees the keys at positions p - W < j <= p
(`kvlib.ops.attention.visible`, as `kvlib.cache.ring` counts it). After `num_positions` = n tokens
the next query is at position n, and every later query is further on, so the keys at positions
j <= n - W are **dead**: no current or future query reads them. A logical block is freeable
when every position it covers is dead, i.e. its last position (i + 1) · block_size - 1 <= n - W:

    freeable blocks = range(num_sink_blocks, (n - W + 1) // block_size)

(n - W + 1 dead positions, vLLM's "skipped tokens"; only whole blocks are freed, so up to
block_size - 1 dead positions stay held in the window's first block). With `sink_tokens` s
(StreamingLLM, Xiao et al., ICLR 2024: the first s positions stay visible to every query), the
ceil(s / block_size) blocks holding them are never freed. The block a future token will be
written into is never dead (its free slots are future positions), so an append never lands in a
freed block.

Mistral 7B (Jiang et al., 2023) keeps a window in a **rolling buffer** of W slots, position j in
slot j mod W (`kvlib.cache.ring.RingCache`). A paged cache gets the same bound differently: its
blocks stay where they are and the dead ones go back to the pool, as vLLM's sliding-window KV
cache manager does (its hybrid KV cache manager keeps one block table per group of layers of one
attention type, and the sliding-window group's dead entries are replaced by a shared **null
block**). The freed memory then serves other sequences or full-attention layers.

**Why a null block and not `BlockManager.drop_blocks`.** Dropping a table entry (chapter 9's
compaction) shifts every later entry down, so slot = table[p // block_size] · block_size +
p % block_size no longer holds for the live positions: every later read and write would need a
position offset. `free_window_blocks` keeps the table's length and points each dead entry at the
manager's null block (`BlockManager.reserve_null_block`: one reserved block, never written), so
the slot mapping, `read_slots`, chapter 11's kernel and `fork` work unchanged; reads that land in
the null block are for dead positions, which the window mask hides. A block another sequence
still holds (a prefix-cache hit, a fork) only loses this sequence's reference: it returns to the
pool when its last holder lets go (the reference count, chapter 7), never while the other
sequence's window still needs it.

- `live_block_range`, `freeable_blocks`: the arithmetic (pure functions);
- `free_window_blocks`: frees a sequence's dead blocks in a `BlockManager`;
- `PagedWindowCache`: `kvlib.cache.PagedCache` for a model with `sliding_window`, freeing after
  every step: its blocks in use stop growing at about W / block_size + 1 per sequence.

What it deliberately does not do: attend over fewer blocks (the torch reference gathers every
position, the dead ones from the null block, and masks them; a kernel would start its loop at
the window's first block), per-layer windows or groups of layers with different windows (one
window for the whole model, as `ModelConfig.sliding_window` has it), rollback (a rolled-back
sequence would need dead positions again: `truncate` refuses), prefix hits that skip the dead
blocks (a prompt's prefix hit still needs every leading block cached; vLLM's sliding-window
manager accepts a hit that misses blocks outside the window).
"""

from __future__ import annotations

from typing import NamedTuple

from kvlib._validate import check_positive_int
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.paged import PagedCache

__all__ = [
    "LiveBlocks",
    "PagedWindowCache",
    "free_window_blocks",
    "freeable_blocks",
    "live_block_range",
]


class LiveBlocks(NamedTuple):
    """The logical blocks of a sequence that a current or future query may still read: `sinks`,
    range(0, ceil(sink_tokens / block_size)), and `window`, the blocks from the one holding
    position n - W + 1 to the last block the sequence holds (both clipped to the blocks held:
    range(0, ceil(n / block_size))). The two may overlap; every other block is freeable."""

    sinks: range
    window: range


def live_block_range(
    num_positions: int, window: int, block_size: int, sink_tokens: int = 0
) -> LiveBlocks:
    """The live logical blocks of a sequence of `num_positions` tokens (positions 0 .. n - 1)
    whose next query is at position n, for a window of `window` positions (a query at p sees
    p - W < j <= p) and `sink_tokens` always-visible first positions.

    Units: positions and blocks are counts (logical block i holds positions i · block_size ..
    (i + 1) · block_size - 1). Returns a `LiveBlocks` of two ranges of logical block indices.

    Raises:
        TypeError: an argument that is not an int.
        ValueError: `num_positions` or `sink_tokens` < 0, `window` or `block_size` < 1.
    """
    n = check_positive_int("num_positions", num_positions, allow_zero=True)
    window = check_positive_int("window", window)
    block_size = check_positive_int("block_size", block_size)
    sink_tokens = check_positive_int("sink_tokens", sink_tokens, allow_zero=True)
    num_blocks = -(-n // block_size)  # blocks the sequence holds
    num_dead_positions = max(0, n - window + 1)  # positions 0 .. n - W: no query at >= n sees them
    first_live = min(num_blocks, num_dead_positions // block_size)  # whole dead blocks before it
    num_sink_blocks = min(num_blocks, -(-sink_tokens // block_size))
    return LiveBlocks(range(num_sink_blocks), range(first_live, num_blocks))


def freeable_blocks(
    num_positions: int, window: int, block_size: int, sink_tokens: int = 0
) -> list[int]:
    """The logical block indices, ascending, that no query at position >= `num_positions` can
    read: every position they cover is <= num_positions - window and none is a sink. Arguments
    and errors as `live_block_range`'s."""
    live = live_block_range(num_positions, window, block_size, sink_tokens)
    return list(range(live.sinks.stop, live.window.start))


def free_window_blocks(
    manager: BlockManager, seq_id, window: int, *, sink_tokens: int = 0
) -> list[int]:
    """Give back the blocks of sequence `seq_id` that its window has left (`freeable_blocks` for
    its token count, `manager.num_tokens(seq_id)`): each such table entry not already the null
    block is pointed at it (`manager.reserve_null_block()`, reserved on the first call) and the
    block's reference is freed, the table's tail first (the free queue then evicts a prefix's tail
    before its head, as `BlockManager.free` orders it). A block other sequences still hold
    (`ref_cnt` > 1: a prefix hit, a fork) stays theirs; a block freed to 0 keeps its hash, so a
    later prompt with the same prefix may still take it back. Idempotent.

    Returns the physical block ids whose reference this call gave back (ascending logical order).

    Raises:
        KeyError: an unknown sequence.
        TypeError, ValueError: `window` or `sink_tokens` as in `live_block_range`.
        OutOfBlocksError: the null block is not reserved yet and no block is free.
    """
    table = manager.block_tables[seq_id]
    dead = freeable_blocks(manager.num_tokens(seq_id), window, manager.block_size, sink_tokens)
    if not dead:
        return []
    null_block = manager.reserve_null_block()
    released = [i for i in dead if table[i] != null_block]
    blocks = [table[i] for i in released]
    manager.pool.touch([null_block] * len(released))  # one reference per entry, as any block
    for i in released:
        table[i] = null_block
    manager.pool.free(reversed(blocks))
    return blocks


class PagedWindowCache(PagedCache):
    """A paged cache for a sliding-window model: after each forward (`advance`), every sequence's
    dead blocks go back to the pool (`free_window_blocks`), their table entries pointing at the
    null block. Layout, slot mapping and attention (`paged_attention`, under the model's window
    mask) as `PagedCache`'s; the null block, reserved at construction, is counted in
    `num_blocks_in_use` and `nbytes`.

    Args:
        window: W >= 1, the model's `sliding_window`.
        The others: as `PagedCache`'s.

    Raises (besides `PagedCache`'s): `truncate` and `move_tokens` raise NotImplementedError (the
    positions a rollback needs again may be freed); `for_model` raises ValueError for a model
    without a sliding window or a `window` other than its own.
    """

    rollback_refusal = (
        "the blocks of positions that left the window went back to the pool; a rollback would "
        "need them again"
    )

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, window: int, **kw):
        self.window = check_positive_int("window", window)
        super().__init__(num_layers, num_kv_heads, head_dim, **kw)
        self.manager.reserve_null_block()  # a fresh pool's block: zeros, finite under the mask
        self.freed_blocks = 0  # block references given back by the window so far

    @classmethod
    def for_model(
        cls, model, num_sequences: int, max_seq_len: int, *, window: int | None = None, **options
    ) -> PagedWindowCache:
        """`PagedCache.for_model` with the model's `sliding_window` (`window`, if given, must be
        the same). A hybrid model (`layer_types`) is refused."""
        if getattr(model.config, "layer_types", None) is not None:  # chapter 17's hybrids
            raise ValueError(
                f"model: its layers are of several kinds ({model.config.layer_types}); a "
                "PagedWindowCache would window every layer: use kvlib.cache.HybridCache"
            )
        configured = model.config.sliding_window
        if configured is None or (window is not None and window != configured):
            raise ValueError(
                f"window: expected the model's sliding_window ({configured}; a model with none "
                f"needs no window cache), got {window}"
            )
        return super().for_model(model, num_sequences, max_seq_len, window=configured, **options)

    def advance(self, num_tokens: int) -> None:
        """Commit the step (`PagedCache.advance`), then free every sequence's dead blocks."""
        super().advance(num_tokens)
        for seq_id in list(self.manager.block_tables):
            self.freed_blocks += len(free_window_blocks(self.manager, seq_id, self.window))

    def repeat(self, num_copies: int) -> PagedWindowCache:
        """As `PagedCache.repeat`; the copies share the null block as any block."""
        bigger = super().repeat(num_copies)
        self.manager.reserve_null_block()  # this cache's new, empty manager
        return bigger
