"""The block allocator of a paged KV cache (chapter 7): a pool of reference-counted blocks with
prefix caching, and the per-sequence block tables built on it.

PagedAttention (Kwon et al., 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP) stores the cache in fixed-size physical blocks of `block_size` token
slots. A sequence's **block table** lists its blocks in logical order: token `t` lives in block
`block_table[t // block_size]`, slot `t % block_size`, so its **slot** in the flattened pool is
`block_table[t // block_size] * block_size + t % block_size` (the **slot mapping**). Blocks are
only allocated as tokens arrive, so a sequence wastes at most one partly filled block.

Two layers, named as vLLM v1 (`block_pool.py`, `kv_cache_manager.py`) and nano-vllm
(`block_manager.py`) name them:

- `BlockPool`: the blocks (`block_id`, `ref_cnt`, `block_hash`), a free queue, and the prefix
  cache (block hash -> block). `allocate` takes blocks off the free queue's front, `touch` shares
  blocks (reference count up), `free` gives a reference back; a block whose count reaches 0 goes
  to the back of the free queue, **still holding its K/V and its hash**, so a later request with
  the same prefix can take it back (`touch`) until it is evicted by an allocation: least
  recently freed first (LRU).
- `BlockManager` (`kvlib.cache.block_manager`): sequences. `allocate(seq_id, token_ids)` gives a
  new sequence its blocks, reusing cached full blocks of its prefix; `append_slot` adds one token
  (a new block when the last one is full; **copy-on-write** when the last block is shared); `fork`
  shares a sequence's blocks with a new one (parallel sampling, beam search); `free` releases a
  sequence.

**Prefix caching.** A full block's hash covers its parent block's hash and its own tokens
(`hash_block_tokens`), so equal hashes mean equal prefixes, not merely equal blocks. The hash is
SHA-256, a cryptographic hash: vLLM moved to it after a security advisory showed that predictable
hashes let one tenant craft a prompt whose blocks collide with another tenant's prefix and read its
cached K/V. With SHA-256 a collision cannot be crafted and is vanishingly unlikely by chance, so
the token ids are not compared again on a hit. Only full blocks are hashed (a partly filled block
still changes), and a hit covers at most `n - 1` of a prompt's `n` tokens: the last token must be
computed, because its logits are what the request needs (nano-vllm crashed on a full hit).

Running out of blocks is a value the caller can act on (`can_allocate`, `num_free_blocks`);
allocating anyway raises `kvlib.errors.OutOfBlocksError`, never a sentinel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvlib._validate import check_positive_int
from kvlib.errors import OutOfBlocksError

__all__ = ["Block", "BlockPool", "hash_block_tokens"]


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: SHA-256 of the parent block's hash (b"" for the first
    block) followed by the block's token ids (each an unsigned 64-bit little-endian integer).
    Returns 32 bytes. Chaining the parent's hash makes the key depend on the whole prefix."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()


@dataclasses.dataclass
class Block:
    """One physical block: `ref_cnt` sequences hold it; `block_hash` is set once it is full and
    cached (None otherwise)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """`num_blocks` blocks of `block_size` slots, a free queue and a prefix cache.

    Raises (from the methods): `OutOfBlocksError` when an allocation needs more blocks than are
    free; `ValueError` for an unknown block id, a block freed more often than it was taken (a
    double free), or a hash given to a block nobody holds.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, least recently freed first; values unused (an ordered set)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block hash -> block id
        self.evictions = 0  # cached blocks whose K/V an allocation overwrote

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still be cached for prefix hits)."""
        return len(self.free_queue)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    def _check_ids(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block_ids: expected ids in [0, {self.num_blocks}), got {i!r}")
        return ids

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks off the front of the free queue (least recently freed first),
        evicting any cached content they hold; each gets `ref_cnt` 1. Returns their ids.

        Raises:
            OutOfBlocksError: fewer than `num_blocks` blocks are free (nothing is taken).
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: expected an int >= 0, got {num_blocks!r}")
        if num_blocks > len(self.free_queue):
            raise OutOfBlocksError(
                f"allocate: {num_blocks} blocks needed, {len(self.free_queue)} of "
                f"{self.num_blocks} free"
            )
        taken = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict: its K/V is about to be overwritten
                if self.cached_blocks.get(block.block_hash) == block_id:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_cnt = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share blocks: each `ref_cnt` goes up by one; a cached free block leaves the free queue
        (a prefix-cache hit brings it back to life)."""
        for block_id in self._check_ids(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back one reference to each block; a block nobody holds any more joins the back of
        the free queue, keeping its hash (and its K/V) for later prefix hits.

        Raises:
            ValueError: a block whose `ref_cnt` is already 0 (a double free); nothing is freed.
        """
        ids = self._check_ids(block_ids)
        taken: dict[int, int] = {}
        for block_id in ids:
            taken[block_id] = taken.get(block_id, 0) + 1
        for block_id, count in taken.items():
            if self.blocks[block_id].ref_cnt < count:
                raise ValueError(
                    f"block_ids: block {block_id} freed {count} time(s) but held "
                    f"{self.blocks[block_id].ref_cnt} time(s): a double free"
                )
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def cache_full_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block under `block_hash` for prefix hits (no-op with prefix caching
        off). If another block already holds that hash, the first one stays the one hits find.

        Raises:
            ValueError: the block is free (its content is not anyone's).
        """
        (block_id,) = self._check_ids([block_id])
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            raise ValueError(f"block_id: block {block_id} is free; only a held block is cached")
        block.block_hash = block_hash
        self.cached_blocks.setdefault(block_hash, block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under `block_hash`, or None (always None with prefix caching off)."""
        return self.cached_blocks.get(block_hash) if self.enable_prefix_caching else None
