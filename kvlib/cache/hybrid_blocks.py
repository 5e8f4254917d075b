"""One pool, one block table per group of layers (chapter 17): the allocator of a model whose
layers differ in kind, after vLLM's hybrid KV cache manager.

With one block table for the whole model (chapter 7), a table entry holds `block_size` tokens of
**every** layer's K/V, so a sliding-window layer keeps every token a full-attention layer keeps
and its window saves nothing. vLLM's hybrid KV cache manager instead cuts the layers into
**groups** of one kind and equal size, gives each group its own block table, and lets every
group draw from **one** pool: a physical block holds `block_size` tokens of one group's layers,
so all blocks have the same bytes and a block a window group gives back can serve a full group
(of this sequence or another) at once.

**Grouping** (`group_layers`, vLLM's `_get_kv_cache_groups_uniform_page_size`, commit 52b9a57d).
The layers of each kind (full, or one window size) are counted; the **group size** G (vLLM's
`group_size`) is the smallest count, or the largest one if it is below 1.5 times the smallest;
each kind's layers are dealt round-robin into ceil(count / G) groups (group i gets
layers[i::num_groups]). Every block has room for G layers, so a group of fewer layers leaves the
rest of each of its blocks empty: **padding** (Gemma 3 27B: 52 sliding layers in six groups of
size 10, eight layers' worth of padding).

**Prefix hits.** Each group hashes its own full blocks, its chain salted by its index
(`BlockManager.root_hash`: two groups' blocks of the same tokens hold different layers' K/V). A
hit of L tokens lets a request start computing at position L. A full group needs its blocks
0 .. L / block_size - 1 cached; a window group only the blocks a query at L can read
(`kvlib.cache.paged_window.live_block_range`: its sinks and its last cdiv(W - 1, block_size)
blocks, fewer while L < W - 1), the ones before them entering the table as the null block. The
longest hit is the largest L, a multiple of `block_size` below the prompt's length, that every
group accepts: each group in turn shortens the candidate until none does (the fixed point of
vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`, commit 52b9a57d).

**Keeping only what a hit can use.** A window group holds only its live blocks while a sequence
runs (`free_dead`); the blocks it gives back keep their hashes and join the back of the pool's
free queue (chapter 7), so they are the first of the sequence's blocks an allocation evicts. A
hit at the sequence's end (the next turn of a conversation) still succeeds after they are gone:
it needs only the window's last blocks, which were freed last within their group, at `free`
(before the full groups' blocks, so they are the next evicted: losing one loses the whole hit,
however much of the prefix the full groups still hold). Chapter 7's rule
(every leading block cached) would find no hit in a window group at all once the first block is
evicted. What is given up: a later request that shares only a shorter prefix needs the window's
blocks at that point, and finds them only if they have not been evicted yet. SGLang's SWA radix
cache makes the same bet explicit: a tree node's window KV is evicted before its full KV (a
tombstone), and a match needs window KV only over its last W tokens (commit 5e24d55a).

Beyond vLLM: the sinks in a window group's hit are the course's (vLLM's sliding-window hit has
none); vLLM keys its cached blocks by (hash, group) where this
module salts each group's chain, and it also allows groups with different block sizes (a hit's
length a multiple of their least common multiple), which this module does not.

What it does not do: hold K/V (each group's layers index their tensors with its table: chapter
12's engine does, `kvlib.engine.hybrid_kv`), recurrent-state groups (vLLM's `MambaManager`: one
block holds a state), per-group block sizes, fork, rollback.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

from kvlib._validate import check_positive_int
from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.cache.paged_window import free_window_blocks, live_block_range
from kvlib.errors import OutOfBlocksError

__all__ = ["HybridBlockManager", "LayerGroup", "fill_pool", "group_layers"]


class LayerGroup(NamedTuple):
    """Layers that share one block table. `layers`: the model's layer indices (ascending);
    `window`: W of their sliding window, None for full attention; `size`: the group size G, the
    layers a block has room for (size - len(layers) layers' worth of each block is padding)."""

    layers: tuple[int, ...]
    window: int | None
    size: int


def group_layers(windows: Sequence[int | None]) -> list[LayerGroup]:
    """Cut a model's layers into groups of one kind and one size (vLLM's rule, module
    docstring). `windows[i]` is layer i's sliding window (tokens, int >= 1) or None (full
    attention). Kinds come in the order of their first layer; every layer is in exactly one group.

    Raises:
        ValueError: no layers, or a window that is not None or an int >= 1 (naming the layer).
    """
    if len(windows) == 0:
        raise ValueError("windows: expected one entry per layer, got none")
    kinds: dict[int | None, list[int]] = {}
    for i, window in enumerate(windows):
        if window is not None:
            check_positive_int(f"windows[{i}]", window)
        kinds.setdefault(window, []).append(i)
    counts = [len(layers) for layers in kinds.values()]
    size = min(counts) if max(counts) >= 1.5 * min(counts) else max(counts)
    groups = []
    for window, layers in kinds.items():
        num_groups = -(-len(layers) // size)
        groups += [
            LayerGroup(tuple(layers[i::num_groups]), window, size) for i in range(num_groups)
        ]
    return groups


class HybridBlockManager:
    """Block tables per layer group over one shared `BlockPool` (module docstring).

    Args:
        pool: the shared pool (its `block_size` is every group's).
        groups: from `group_layers`.
        sink_tokens: the first positions every window group keeps (StreamingLLM sinks), >= 0.

    `tables(seq_id)` gives each group's table; dead window entries name `null_block`. Raises
    (from the methods): `OutOfBlocksError` when the pool runs short (the call changes nothing),
    `KeyError` for an unknown sequence, `ValueError` for a sequence id in use or an empty prompt.
    """

    def __init__(
        self,
        pool: BlockPool,
        groups: Sequence[LayerGroup],
        *,
        sink_tokens: int = 0,
    ):
        if not groups:
            raise ValueError("groups: expected at least one layer group, got none")
        self.pool, self.block_size, self.groups = pool, pool.block_size, list(groups)
        self.sink_tokens = check_positive_int("sink_tokens", sink_tokens, allow_zero=True)
        self.managers = [BlockManager(pool) for _ in self.groups]
        self.null_block = None
        for i, (manager, group) in enumerate(zip(self.managers, self.groups)):
            manager.root_hash = f"layer group {i}".encode()
            if group.window is not None:  # one null block for every window group
                if self.null_block is None:
                    self.null_block = manager.reserve_null_block()
                manager.null_block = self.null_block

    def tables(self, seq_id) -> list[list[int]]:
        """Each group's block table of sequence `seq_id` (physical block ids, logical order)."""
        return [m.block_tables[seq_id] for m in self.managers]

    def num_tokens(self, seq_id) -> int:
        return self.managers[0].num_tokens(seq_id)

    # --- prefix hits ----------------------------------------------------------------------------

    def _chain(self, group: int, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        hashes: list[bytes] = []
        for i in range(num_blocks):
            block = token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(
                hash_block_tokens(hashes[-1] if hashes else self.managers[group].root_hash, block)
            )
        return hashes

    def _needed(self, group: int, num_blocks: int) -> list[int]:
        """The logical blocks group `group` needs cached for a hit of `num_blocks` blocks."""
        window = self.groups[group].window
        if window is None:
            return list(range(num_blocks))
        live = live_block_range(
            num_blocks * self.block_size, window, self.block_size, self.sink_tokens
        )
        return sorted(set(live.sinks) | set(live.window))

    def _accepts(self, group: int, num_blocks: int, cached: list[int]) -> bool:
        """Whether every block group `group` needs for a hit of `num_blocks` blocks is cached,
        `cached` being the prefix sums of the group's cached flags (O(1) per range)."""
        window = self.groups[group].window
        if window is None:
            return cached[num_blocks] == num_blocks
        live = live_block_range(
            num_blocks * self.block_size, window, self.block_size, self.sink_tokens
        )
        return all(cached[r.stop] - cached[r.start] == len(r) for r in live)

    def _chains(self, token_ids: list[int]) -> list[list[bytes]]:
        """Each group's hash chain over the full blocks a hit may cover (never the block of the
        last token); empty with prefix caching off."""
        limit = (len(token_ids) - 1) // self.block_size if self.pool.enable_prefix_caching else 0
        return [self._chain(g, token_ids, limit) for g in range(len(self.groups))]

    def _hit_blocks(self, chains: list[list[bytes]]) -> int:
        """The longest hit, in blocks, given each group's chain (`longest_hit`)."""
        cached = [[0, *accumulate(self.pool.lookup(h) is not None for h in c)] for c in chains]
        hit, changed = len(chains[0]), True
        while changed:  # each group shortens the candidate until none does
            changed = False
            for g in range(len(self.groups)):
                while hit > 0 and not self._accepts(g, hit, cached[g]):
                    hit, changed = hit - 1, True
        return hit

    def longest_hit(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` whose K/V every group holds for a request starting after them:
        the largest multiple of `block_size` below len(token_ids) that every group accepts (module
        docstring). 0 with prefix caching off."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return 0
        return self._hit_blocks(self._chains(token_ids)) * self.block_size

    # --- allocation -----------------------------------------------------------------------------

    def _new_blocks(self, num_tokens_before: int, num_tokens_after: int) -> int:
        return -(-num_tokens_after // self.block_size) - -(-num_tokens_before // self.block_size)

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether `allocate` would succeed now."""
        return self._plan([int(t) for t in token_ids])[3] <= self.pool.num_free_blocks

    def _plan(self, token_ids: list[int]):
        """(hit blocks, each group's chain over them, each group's {logical index: physical
        block} of the hit, blocks the allocation takes from the free queue); hashed once."""
        chains = self._chains(token_ids)
        hit_blocks = self._hit_blocks(chains)
        chains = [chain[:hit_blocks] for chain in chains]
        hits = [
            {i: self.pool.lookup(chains[g][i]) for i in self._needed(g, hit_blocks)}
            for g in range(len(self.groups))
        ]
        fresh = len(self.groups) * self._new_blocks(hit_blocks * self.block_size, len(token_ids))
        revived = {b for h in hits for b in h.values() if self.pool.blocks[b].ref_cnt == 0}
        return hit_blocks, chains, hits, fresh + len(revived)

    def allocate(self, seq_id, token_ids: Sequence[int]) -> int:
        """Give a new sequence, in every group, blocks for its prompt `token_ids`, reusing the
        longest hit (`longest_hit`). Returns the tokens covered by the hit (the caller computes
        the rest). Call `free_dead` after the prompt's forward: its queries still read the keys
        the window is about to leave.

        Raises:
            ValueError: `seq_id` in use, or no tokens.
            OutOfBlocksError: not enough free blocks (nothing is allocated).
        """
        if seq_id in self.managers[0].block_tables:
            raise ValueError(f"seq_id: {seq_id!r} is already allocated")
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("token_ids: expected at least one token")
        hit_blocks, chains, hits, needed = self._plan(token_ids)
        if needed > self.pool.num_free_blocks:
            raise OutOfBlocksError(
                f"allocate: sequence {seq_id!r} needs {needed} blocks across "
                f"{len(self.groups)} layer groups, {self.pool.num_free_blocks} of "
                f"{self.pool.num_blocks} free"
            )
        tables = [
            [hits[g].get(i, self.null_block) for i in range(hit_blocks)]
            for g in range(len(self.groups))
        ]
        for table in tables:  # every group's hits first: a fresh block must not evict one
            self.pool.touch(table)  # one reference per entry, the null block's too
        fresh = self._new_blocks(hit_blocks * self.block_size, len(token_ids))
        for g, manager in enumerate(self.managers):
            manager.block_tables[seq_id] = tables[g] + self.pool.allocate(fresh)
            manager.token_ids[seq_id] = list(token_ids)
            manager.block_hashes[seq_id] = chains[g]
            manager.hash_full_blocks(seq_id)
            manager.prefix_hits += hit_blocks * self.block_size
        return hit_blocks * self.block_size

    def extend(self, seq_id, token_ids: Sequence[int]) -> None:
        """Append tokens to a sequence in every group (a decode step, or the next prefill
        chunk), with new blocks where the last one fills up.

        Raises:
            OutOfBlocksError: not enough free blocks (the sequence is unchanged).
        """
        held = self.num_tokens(seq_id)
        token_ids = [int(t) for t in token_ids]
        fresh = self._new_blocks(held, held + len(token_ids))
        if fresh * len(self.groups) > self.pool.num_free_blocks:
            raise OutOfBlocksError(
                f"extend: sequence {seq_id!r} needs {fresh * len(self.groups)} blocks, "
                f"{self.pool.num_free_blocks} of {self.pool.num_blocks} free"
            )
        for manager in self.managers:
            manager.block_tables[seq_id].extend(self.pool.allocate(fresh))
            manager.token_ids[seq_id].extend(token_ids)
            manager.hash_full_blocks(seq_id)

    def free_dead(self, seq_id) -> int:
        """Give back every window group's dead blocks of the sequence
        (`kvlib.cache.paged_window.free_window_blocks`: the table entries point at the null block,
        the blocks keep their hashes). Returns the blocks whose reference was given back."""
        released = 0
        for manager, group in zip(self.managers, self.groups):
            if group.window is not None:
                released += len(
                    free_window_blocks(manager, seq_id, group.window, sink_tokens=self.sink_tokens)
                )
        return released

    def free(self, seq_id) -> None:
        """Release a sequence in every group (its dead window blocks first, as `free_dead`); the
        blocks keep their hashes for later hits."""
        self.free_dead(seq_id)
        for manager in self.managers:
            manager.free(seq_id)

    def cached_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Per group, how many of the full blocks of `token_ids` the prefix cache holds now
        (held or free, under that group's hashes)."""
        token_ids = [int(t) for t in token_ids]
        num_blocks = len(token_ids) // self.block_size
        return [
            sum(self.pool.lookup(h) is not None for h in self._chain(g, token_ids, num_blocks))
            for g in range(len(self.groups))
        ]

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block's `ref_cnt` equals the table entries naming it
        across all groups (+1 for the null block's reservation), the free queue holds exactly the
        blocks nobody holds, and every table has ceil(tokens / block_size) entries."""
        held = [0] * self.pool.num_blocks
        for manager in self.managers:
            for seq_id, table in manager.block_tables.items():
                needed = -(-manager.num_tokens(seq_id) // self.block_size)
                assert len(table) == needed, f"{seq_id!r}: {len(table)} blocks for {needed}"
                for block in table:
                    held[block] += 1
        if self.null_block is not None:
            held[self.null_block] += 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, {held[block.block_id]} held"
            )
        free = sorted(b.block_id for b in self.pool.blocks if b.ref_cnt == 0)
        assert sorted(self.pool.free_queue) == free, "the free queue is not the unheld blocks"


def fill_pool(manager: HybridBlockManager, seq_len: int, *, chunk: int) -> int:
    """Admit sequences of `seq_len` distinct tokens, one after another, each prefilled in chunks
    of `chunk` tokens (`allocate`, then `extend`; `free_dead` after each chunk), until the pool
    refuses a chunk. Returns the sequences whose whole prompt fit (the refused one, partly
    allocated, is not counted and stays allocated). Units: tokens.

    Raises:
        TypeError, ValueError: `seq_len` or `chunk` not an int >= 1.
    """
    seq_len, chunk = check_positive_int("seq_len", seq_len), check_positive_int("chunk", chunk)
    admitted = 0
    while True:
        tokens = range(admitted * seq_len, (admitted + 1) * seq_len)  # no prefix shared
        try:
            manager.allocate(admitted, tokens[:chunk])
            manager.free_dead(admitted)
            for start in range(chunk, seq_len, chunk):
                manager.extend(admitted, tokens[start : start + chunk])
                manager.free_dead(admitted)
        except OutOfBlocksError:
            return admitted
        admitted += 1
