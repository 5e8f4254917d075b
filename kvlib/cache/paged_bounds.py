"""Chapter 7's paged cache, with the element-wise minimum and maximum of each block's keys kept
beside the block (Quest's page metadata; Tang et al., ICML 2024, "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference").

Layout per layer: the pools of `kvlib.cache.paged.PagedCache`, `key_cache` and `value_cache`
`(num_blocks, block_size, H_kv, D)`, and two more per-block tensors, `key_min` and `key_max`
`(num_blocks, H_kv, D)`: for block n and KV head h, `key_min[n, h, i]` is the smallest i-th
coordinate over the keys the block holds (the keys as cached, after RoPE), `key_max` the largest.
They are kept **as blocks fill**: each write folds the new keys in (`scatter_reduce_` with amin
/ amax), and a write into a block's first slot starts the block afresh, so a reused block never
keeps a bound of the keys it held before, and the partial newest block always bounds exactly the
tokens it holds. A block copied for copy-on-write carries its bounds along (they are per-block
pools like the others, `_pools`), and `nbytes` counts them: `2 · H_kv · D` elements per block and
layer, the size of one token's key and value, so `1 / block_size` of the cache.

What it does not do: use the bounds. Selecting pages with them and attending over the selection is
`kvlib.sparse` (chapter 15); `PageBoundsCache` on its own attends densely, as `PagedCache` does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlib.cache.paged import PagedCache

__all__ = ["PageBoundsCache", "PageBoundsKV"]


class PageBoundsKV(NamedTuple):
    """What `PageBoundsCache.update` returns for one layer: `kvlib.cache.paged.PagedKV`'s fields
    (the pools, `block_tables (B, max_blocks) int64`, `seq_lens (B,) int64`, `positions`), the
    layer's `key_min` and `key_max` `(num_blocks, H_kv, D)`, and `layer_idx`."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor | None
    key_min: torch.Tensor
    key_max: torch.Tensor
    layer_idx: int


class PageBoundsCache(PagedCache):
    """A `PagedCache` that keeps per-block key minima and maxima (see the module docstring).

    Args: as `PagedCache`. Attributes: `key_min`, `key_max`: one `(num_blocks, H_kv, D)` tensor
    per layer, in the cache's dtype; a block's entries are meaningful once a key was written to
    it. Raises: as `PagedCache`.
    """

    def _make_pools(self, num_blocks: int, device: torch.device) -> None:
        super()._make_pools(num_blocks, device)
        shape = (num_blocks, self.num_kv_heads, self.head_dim)
        self.key_min = [
            torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)
        ]
        self.key_max = [
            torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)
        ]

    def _pools(self) -> list[torch.Tensor]:
        return super()._pools() + self.key_min + self.key_max

    def _move_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """The moved K/V, and the bounds of every block written recomputed from all its slots
        (the next `truncate` recomputes its partial block from the slots it keeps)."""
        for pool in self.key_cache + self.value_cache:
            flat = pool.flatten(0, 1)
            flat[dst_slots] = flat[src_slots]
        for block in sorted({s // self.block_size for s in dst_slots}):
            self._truncated_block(block, self.block_size)

    def _truncated_block(self, block: int, kept_slots: int) -> None:
        """A rollback's partial block: its dropped slots zeroed and its bounds recomputed from
        the keys it keeps (the same minima and maxima the writes folded in, exactly)."""
        for pool in self.key_cache + self.value_cache:
            pool[block, kept_slots:] = 0
        for keys, key_min, key_max in zip(self.key_cache, self.key_min, self.key_max):
            key_min[block] = keys[block, :kept_slots].amin(dim=0)  # (H_kv, D)
            key_max[block] = keys[block, :kept_slots].amax(dim=0)

    def _write(self, layer_idx, slots, new_k, new_v, handle) -> PageBoundsKV:
        """Store the step's keys and values `(N, H_kv, D)` at pool `slots` `(N,)` and fold the
        keys into their blocks' bounds."""
        paged = super()._write(layer_idx, slots, new_k, new_v, handle)
        key_min, key_max = self.key_min[layer_idx], self.key_max[layer_idx]
        blocks = slots // self.block_size  # (N,) the block each new key lands in
        starting = blocks[slots % self.block_size == 0]  # blocks whose first slot is written now
        key_min[starting] = float("inf")  # a fresh block bounds nothing yet
        key_max[starting] = float("-inf")
        index = blocks[:, None, None].expand_as(new_k)  # (N, H_kv, D)
        key_min.scatter_reduce_(0, index, new_k, "amin")  # (num_blocks, H_kv, D)
        key_max.scatter_reduce_(0, index, new_k, "amax")
        return PageBoundsKV(*paged, key_min, key_max, layer_idx)
