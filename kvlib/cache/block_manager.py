"""The paged cache's sequences (chapter 7): `BlockManager` gives each sequence its block table on
top of `kvlib.cache.block_pool.BlockPool`, named as nano-vllm's `block_manager.py` names it.

`allocate(seq_id, token_ids)` gives a new sequence its blocks, reusing cached full blocks of its
prefix; `append_slot` adds one token (a new block when the last one is full; **copy-on-write**
when the last block is shared); `fork` shares a sequence's blocks with a new one (parallel
sampling, beam search); `free` releases a sequence; `drop_blocks` and `move_slots` are chapter 9's
compaction; `reserve_null_block` gives chapter 17's sliding windows a block for the table entries
no query reads any more; `check_invariants` tests the reference counts against the tables after
any operation.
What it does not do: hold K/V (the caches do) or decide who runs (the engine's scheduler).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvlib.cache.block_pool import BlockPool, hash_block_tokens
from kvlib.errors import OutOfBlocksError


class BlockManager:
    """Block tables of the sequences of a batch, over a `BlockPool`.

    Per sequence (a hashable `seq_id`): its block table (physical block ids in logical order), its
    token count, its token ids (what the prefix-cache hashes cover) and the hashes of its full
    blocks. `slot(seq_id, t)` is the slot mapping.

    Raises (from the methods): `OutOfBlocksError` when the pool runs out (the call changes
    nothing); `KeyError` for an unknown sequence; `ValueError` for a sequence id already in use, an
    empty prompt, or a token position the sequence does not hold.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.block_tables: dict[object, list[int]] = {}
        self.token_ids: dict[object, list[int]] = {}
        self.block_hashes: dict[object, list[bytes]] = {}  # of the sequence's full blocks
        self.prefix_hits = 0  # tokens whose K/V came from the prefix cache
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies owed to copy-on-write
        self.unhashed: set = set()  # sequences that evicted tokens: their new blocks are not hashed
        self.null_block: int | None = None  # chapter 17: what dead window entries point at
        # chapter 17: the first block's parent hash; one per layer group, so that two groups'
        # blocks of the same tokens (different layers' K/V) never answer each other's lookups
        self.root_hash: bytes | None = None

    def reserve_null_block(self) -> int:
        """The null block (vLLM's `BlockPool.null_block`): one block taken from the pool once and
        never given back, for the block-table entries of positions no query reads any more (a
        sliding window's, `kvlib.cache.paged_window`). A table so keeps its length and `slot`
        still holds for every live position. Each table entry naming it holds one reference, as
        any entry does (so `fork` and `free` need no special case); the reservation holds one
        more, so it never reaches the free queue. Nothing writes it: reads of it are masked,
        which weighs them exactly 0, so its K/V must be finite (0 · NaN is NaN): reserve it before
        any K/V is written (a fresh pool's zeros), or zero it. Returns its id (the same one on
        every call).

        Raises:
            OutOfBlocksError: on the first call, no block is free.
        """
        if self.null_block is None:
            (self.null_block,) = self.pool.allocate(1)
        return self.null_block

    def num_tokens(self, seq_id) -> int:
        return len(self.token_ids[seq_id])

    def _new_id(self, seq_id) -> None:
        if seq_id in self.block_tables:
            raise ValueError(f"seq_id: {seq_id!r} is already allocated")

    def _cached_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The leading full blocks of `token_ids` the prefix cache holds (never the block of the
        last token), and their chained hashes: ([block ids], [hashes])."""
        hits, hashes = [], []
        if not self.pool.enable_prefix_caching:
            return hits, hashes
        for i in range((len(token_ids) - 1) // self.block_size):  # never the whole prompt
            block_hash = hash_block_tokens(
                hashes[-1] if hashes else self.root_hash,
                token_ids[i * self.block_size : (i + 1) * self.block_size],
            )
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(block_hash)
        return hits, hashes

    def _fits(self, num_tokens: int, hits: list[int]) -> bool:
        needed = -(-num_tokens // self.block_size) - len(hits)
        revived = sum(self.pool.blocks[b].ref_cnt == 0 for b in hits)  # leave the free queue
        return needed <= self.pool.num_free_blocks - revived

    def num_cached_prefix_blocks(self, token_ids: Sequence[int]) -> tuple[int, list[int]]:
        """How many of `token_ids`' leading full blocks the prefix cache holds, capped so that at
        least the last token is left to compute; returns (number of tokens covered, block ids)."""
        hits, _ = self._cached_prefix(token_ids)
        return len(hits) * self.block_size, hits

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        """Whether `allocate` would succeed now (counting cached blocks it would reuse)."""
        return self._fits(len(token_ids), self._cached_prefix(token_ids)[0])

    def allocate(self, seq_id, token_ids: Sequence[int]) -> int:
        """Give a new sequence blocks for its prompt `token_ids`, reusing cached blocks of its
        prefix (at most len - 1 tokens). Returns how many leading tokens' K/V are already cached
        (a multiple of block_size): the caller computes only the rest.

        Raises:
            OutOfBlocksError: not enough free blocks (nothing is allocated).
        """
        self._new_id(seq_id)
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("token_ids: expected at least one token")
        hits, hashes = self._cached_prefix(token_ids)  # hashed once, here
        if not self._fits(len(token_ids), hits):
            raise OutOfBlocksError(
                f"allocate: sequence {seq_id!r} needs blocks for {len(token_ids)} tokens, "
                f"{self.pool.num_free_blocks} of {self.pool.num_blocks} blocks free"
            )
        self.pool.touch(hits)
        fresh = self.pool.allocate(-(-len(token_ids) // self.block_size) - len(hits))
        self.block_tables[seq_id] = hits + fresh
        self.token_ids[seq_id] = token_ids
        self.block_hashes[seq_id] = hashes  # the hit blocks are cached under these already
        self.hash_full_blocks(seq_id)
        covered = len(hits) * self.block_size
        self.prefix_hits += covered
        return covered

    def hash_full_blocks(self, seq_id) -> None:
        """Hash and cache every full block of the sequence not hashed yet, up to the first block
        holding a token not known yet (nothing to do with prefix caching off: no lookup would
        read the hashes). Every method that adds tokens calls it; an allocator that builds a
        table itself calls it too (`kvlib.cache.hybrid_blocks`)."""
        if not self.pool.enable_prefix_caching or seq_id in self.unhashed:
            return
        tokens, hashes = self.token_ids[seq_id], self.block_hashes[seq_id]
        table = self.block_tables[seq_id]
        while (len(hashes) + 1) * self.block_size <= len(tokens):
            i = len(hashes)
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            if None in block_tokens:  # hashed by `set_token` once the token is known
                return
            block_hash = hash_block_tokens(hashes[-1] if hashes else self.root_hash, block_tokens)
            hashes.append(block_hash)
            self.pool.cache_full_block(table[i], block_hash)

    def append_slot(self, seq_id, token_id: int | None) -> int:
        """Add one token to a sequence; return its slot. Allocates a block when the last one is
        full. **Copy-on-write**: if the last block is partly filled and shared (ref_cnt > 1), the
        sequence gets a private copy first; the (src, dst) pair is appended to `copies`, for the
        cache to copy the K/V of the slots already written.

        `token_id` None: a token whose id is not known yet (an engine that plans the next step
        while this one's tokens are still on the device, chapter 12); its block is hashed for the
        prefix cache only once `set_token` gives the id.

        Raises:
            OutOfBlocksError: a block is needed and none is free (the sequence is unchanged).
        """
        table, tokens = self.block_tables[seq_id], self.token_ids[seq_id]
        position = len(tokens)
        if position % self.block_size == 0:  # every block full (or none): a new one
            table.extend(self.pool.allocate(1))
        else:
            last = table[-1]
            if self.pool.blocks[last].ref_cnt > 1:
                (copy,) = self.pool.allocate(1)
                self.pool.free([last])
                table[-1] = copy
                self.copies.append((last, copy))
        tokens.append(None if token_id is None else int(token_id))
        self.hash_full_blocks(seq_id)
        return table[-1] * self.block_size + position % self.block_size

    def set_token(self, seq_id, position: int, token_id: int) -> None:
        """Give the id of token `position`, appended as not known yet (`append_slot(seq_id,
        None)`), and hash the blocks it completes.

        Raises:
            ValueError: the sequence does not hold that position, or its id is known already.
        """
        tokens = self.token_ids[seq_id]
        if not 0 <= position < len(tokens) or tokens[position] is not None:
            raise ValueError(
                f"position: expected a token of sequence {seq_id!r} whose id is not known yet, "
                f"got {position} ({len(tokens)} tokens)"
            )
        tokens[position] = int(token_id)
        self.hash_full_blocks(seq_id)

    def fork(self, parent_id, child_id) -> None:
        """A new sequence sharing all of `parent_id`'s blocks (each `ref_cnt` + 1): parallel
        sampling and beam search. Its first append into a shared partial block copies it."""
        self._new_id(child_id)
        table = self.block_tables[parent_id]
        self.pool.touch(table)
        self.block_tables[child_id] = list(table)
        self.token_ids[child_id] = list(self.token_ids[parent_id])
        self.block_hashes[child_id] = list(self.block_hashes[parent_id])
        if parent_id in self.unhashed:
            self.unhashed.add(child_id)

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep a sequence's first `num_tokens` tokens (chapter 13: a child forked after its
        parent's prefill recomputes the prompt's last token, to sample its own first token; a
        speculative step rolls back its rejected tokens): blocks left empty are freed, hashes of
        blocks no longer full dropped, and a partly filled last block that is shared is copied
        now (copy-on-write, the pair appended to `copies`), so the next `append_slot` needs
        exactly the blocks its token count says. Blocks held by this sequence alone that the
        rollback touches leave the prefix cache: a partly filled last block (its freed slots will
        be written again, and a later prompt must not find the old tokens' hash on the new K/V)
        and every block dropped whole (its tokens were rolled back: a speculative step's rejected
        tokens, whose K/V a draft may have computed inexactly). Shared blocks keep their hashes:
        their K/V stay the other holders'. (A speculating engine should also append draft slots
        with `append_slot(seq_id, None)` and `set_token` only the accepted ones, so a rejected
        token is never hashed at all.)

        Raises:
            ValueError: `num_tokens` outside [1, the sequence's tokens].
            OutOfBlocksError: the copy needs a block and none is free (nothing is changed).
        """
        tokens, table = self.token_ids[seq_id], self.block_tables[seq_id]
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens: expected an int, got {num_tokens!r}")
        if not 1 <= num_tokens <= len(tokens):
            raise ValueError(f"num_tokens: expected 1..{len(tokens)}, got {num_tokens}")
        keep_blocks = -(-num_tokens // self.block_size)
        last = table[keep_blocks - 1]
        copy = num_tokens % self.block_size != 0 and self.pool.blocks[last].ref_cnt > 1
        if copy and not self.pool.num_free_blocks:
            raise OutOfBlocksError(f"truncate: sequence {seq_id!r} needs a block, none is free")
        hashes, cut = self.block_hashes[seq_id], num_tokens // self.block_size
        if cut < len(hashes) and num_tokens % self.block_size and not copy:
            self.uncache(last)  # a shared block keeps its hash: the others' K/V stay
        del hashes[cut:]
        dropped = table[keep_blocks:]
        for block in dropped:
            if self.pool.blocks[block].ref_cnt == 1:
                self.uncache(block)
        del table[keep_blocks:], tokens[num_tokens:]
        self.pool.free(reversed(dropped))
        if copy:
            (table[-1],) = self.pool.allocate(1)
            self.pool.free([last])
            self.copies.append((last, table[-1]))

    def free(self, seq_id) -> None:
        """Release a sequence: its blocks are freed last block first, so that the free queue
        evicts a prefix's tail before its head (vLLM's order)."""
        table = self.block_tables.pop(seq_id)
        del self.token_ids[seq_id], self.block_hashes[seq_id]
        self.unhashed.discard(seq_id)
        self.pool.free(reversed(table))

    # --- eviction and compaction (chapter 9) ----------------------------------------------------

    def stop_hashing(self, seq_id) -> None:
        """Hash none of the sequence's blocks from now on: call it when the sequence first evicts
        a token. Its later tokens' K/V are computed without the evicted tokens, so they are not
        what a fresh prefill of the same prefix computes, and a prefix hit on them would hand
        another request wrong K/V. Blocks hashed before keep their hashes (their K/V is intact)."""
        self.block_tables[seq_id]  # KeyError for an unknown sequence
        self.unhashed.add(seq_id)

    def _forget_hashes(self, seq_id, from_block: int) -> None:
        """Drop the sequence's chained hashes from block index `from_block` on, and take the blocks
        there whose content is about to change out of the prefix cache."""
        hashes, table = self.block_hashes[seq_id], self.block_tables[seq_id]
        for i in range(from_block, len(hashes)):
            self.uncache(table[i])
        del hashes[from_block:]

    def uncache(self, block_id: int) -> None:
        """Take a block out of the prefix cache (its hash no longer describes its content)."""
        block = self.pool.blocks[block_id]
        if block.block_hash is not None:
            if self.pool.cached_blocks.get(block.block_hash) == block_id:
                del self.pool.cached_blocks[block.block_hash]
            block.block_hash = None

    def drop_blocks(self, seq_id, indices: Iterable[int]) -> list[int]:
        """Remove the blocks at positions `indices` of the sequence's block table (blocks whose
        slots all hold evicted tokens): no K/V moves; the later slots' indices shift down by
        `block_size` each, so the caller's slot -> position map must drop the same slots. The
        blocks' references are freed. Returns the physical block ids removed.

        Raises:
            ValueError: an index outside the table.
        """
        table, tokens = self.block_tables[seq_id], self.token_ids[seq_id]
        drop = sorted(set(indices))
        for i in drop:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(table):
                raise ValueError(f"indices: expected block indices in [0, {len(table)}), got {i!r}")
        if not drop:
            return []
        self._forget_hashes(seq_id, drop[0])  # the chain no longer matches the table after it
        removed, dropped = [table[i] for i in drop], set(drop)
        self.block_tables[seq_id] = [b for i, b in enumerate(table) if i not in dropped]
        self.token_ids[seq_id] = [
            t for j, t in enumerate(tokens) if j // self.block_size not in dropped
        ]
        self.pool.free(reversed(removed))
        return removed

    def move_slots(self, seq_id, moves: Sequence[tuple[int, int]], num_slots: int) -> list[int]:
        """The allocator's half of a compaction pass: the token in slot index `src` of the sequence
        now lives at `dst` (indices into the sequence's slots, not the pool's), for every
        (src, dst) in `moves` (the caller copies the K/V, all sources read before any
        destination is written); then the sequence keeps its first `num_slots` slots and its
        blocks past them are freed. Blocks written to leave the prefix cache. Returns the physical
        ids of the blocks freed.

        Raises:
            ValueError: a slot index outside the sequence, `num_slots` out of range, or a
                destination in a block another sequence also holds (it would change that
                sequence's K/V: shared blocks are never written in place).
        """
        table, tokens = self.block_tables[seq_id], self.token_ids[seq_id]
        n = len(tokens)
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or not 0 < num_slots <= n:
            raise ValueError(f"num_slots: expected an int in [1, {n}], got {num_slots!r}")
        for src, dst in moves:
            if not (0 <= src < n and 0 <= dst < num_slots):
                raise ValueError(
                    f"moves: expected src in [0, {n}) and dst in [0, {num_slots}), got "
                    f"({src}, {dst})"
                )
            block = self.pool.blocks[table[dst // self.block_size]]
            if block.ref_cnt > 1:
                raise ValueError(
                    f"moves: slot {dst} is in block {block.block_id}, which {block.ref_cnt} "
                    "sequences hold; writing it would change the others' K/V"
                )
        keep = -(-num_slots // self.block_size)  # blocks the sequence keeps
        first_written = min((dst // self.block_size for _, dst in moves), default=keep)
        self._forget_hashes(seq_id, min(first_written, keep))
        moved = list(tokens)
        for src, dst in moves:
            moved[dst] = tokens[src]
        del moved[num_slots:]
        self.token_ids[seq_id] = moved
        freed = table[keep:]
        del table[keep:]
        self.pool.free(reversed(freed))
        return freed

    def slot(self, seq_id, position: int) -> int:
        """The slot of token `position`: block_table[t // block_size] * block_size + t % block_size.

        Raises:
            ValueError: the sequence does not hold that position.
        """
        n = len(self.token_ids[seq_id])
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < n:
            raise ValueError(f"position: expected an int in [0, {n}), got {position!r}")
        block = self.block_tables[seq_id][position // self.block_size]
        return block * self.block_size + position % self.block_size

    def check_invariants(self) -> None:
        """Raise AssertionError (naming the broken rule) unless:

        1. every block's `ref_cnt` equals the number of block-table entries holding it (so the sum
           of reference counts equals the references the tables hold), plus one for the null
           block's reservation;
        2. the free queue holds exactly the blocks with `ref_cnt` 0, each once: free and used are
           disjoint and together cover the pool;
        3. only blocks that are full in some sequence, or free and cached, carry a hash, and the
           prefix cache maps each hash to a block that carries it;
        4. every sequence has exactly ceil(tokens / block_size) blocks.
        """
        pool = self.pool
        held = [0] * pool.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                held[block_id] += 1
        if self.null_block is not None:
            held[self.null_block] += 1  # the reservation
        for block in pool.blocks:
            assert block.ref_cnt == held[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {held[block.block_id]} "
                "block-table references"
            )
        free = [b.block_id for b in pool.blocks if b.ref_cnt == 0]
        assert sorted(pool.free_queue) == free, (
            f"free queue {sorted(pool.free_queue)} != blocks with ref_cnt 0 {free}"
        )
        full = {
            table[i]
            for seq_id, table in self.block_tables.items()
            for i in range(len(self.token_ids[seq_id]) // self.block_size)
        }
        for block in pool.blocks:
            if block.block_hash is not None:
                assert block.block_id in full or block.ref_cnt == 0, (
                    f"block {block.block_id} is hashed but not full in any sequence"
                )
        for block_hash, block_id in pool.cached_blocks.items():
            assert pool.blocks[block_id].block_hash == block_hash, (
                f"the prefix cache maps a hash to block {block_id}, which does not carry it"
            )
        for seq_id, table in self.block_tables.items():
            needed = -(-len(self.token_ids[seq_id]) // self.block_size)
            assert len(table) == needed, (
                f"sequence {seq_id!r}: {len(table)} blocks for {len(self.token_ids[seq_id])} tokens"
            )
