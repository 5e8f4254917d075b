"""Block tables for a paged KV cache whose blocks a busy allocator has scattered.

A paged cache (PagedAttention, Kwon et al., 2023) stores K/V in fixed-size physical blocks of a
pool; a sequence's block table lists, in logical order, the physical blocks that hold its tokens
(token t lives in block `block_tables[b, t // block_size]`, slot `t % block_size`; chapter 7).
`shuffled_block_tables` allocates them from chapter 7's allocator (`kvlib.cache.block_pool`) after
a history that leaves its free queue in random order, so the kernel's tests, its benchmark and
chapter 11 see logical order != physical order.
"""

from __future__ import annotations

import math

import torch

from kvlib.cache.block_manager import BlockManager
from kvlib.cache.block_pool import BlockPool

__all__ = ["shuffled_block_tables"]


def shuffled_block_tables(
    seq_lens,
    block_size: int,
    *,
    spare_blocks: int = 0,
    generator: torch.Generator | None = None,
    device="cpu",
) -> tuple[torch.Tensor, int]:
    """Block tables for a paged cache whose physical blocks are in random order, as a busy
    allocator leaves them (PagedAttention, Kwon et al., 2023): sequence b gets
    ceil(seq_lens[b] / block_size) distinct blocks of a pool of sum(...) + `spare_blocks` blocks,
    allocated by `kvlib.cache.block_manager.BlockManager` from a free queue in the order `generator`
    shuffles it.

    Returns `(block_tables, num_blocks)`: `block_tables (B, max_blocks_per_seq) int32` on `device`
    (entries past a sequence's last block are 0), and the pool size. Used by the tests, the
    benchmark and chapter 11 to build inputs where logical order != physical order.
    Raises ValueError for an empty batch, lengths < 1, block_size < 1 or spare_blocks < 0.
    """
    lengths = [int(n) for n in seq_lens]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"seq_lens: expected at least one length, all >= 1; got {lengths}")
    if block_size < 1 or spare_blocks < 0:
        raise ValueError(
            f"block_size: expected >= 1 and spare_blocks >= 0; got {block_size} and {spare_blocks}"
        )
    blocks_needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(blocks_needed) + spare_blocks
    order = torch.randperm(
        num_blocks, generator=generator, device=generator.device if generator is not None else "cpu"
    ).tolist()
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
    everything = pool.allocate(num_blocks)  # a busy history: every block taken, then given
    pool.free(everything[i] for i in order)  # back in random order
    manager = BlockManager(pool)
    block_tables = torch.zeros(len(lengths), max(blocks_needed), dtype=torch.int32)
    for b, n in enumerate(lengths):
        manager.allocate(b, [0] * n)
        block_tables[b, : blocks_needed[b]] = torch.tensor(manager.block_tables[b])
    manager.check_invariants()
    return block_tables.to(device), num_blocks
