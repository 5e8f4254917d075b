"""KV caches: the interface (`base`) and its implementations, one module each.

- `base.KVCache`: what the model needs of a cache (the attention seam);
- `dense.DynamicCache`, `dense.StaticCache`: contiguous `(B, H_kv, S, D)` caches (chapter 2);
- `latent.LatentCache`: MLA's cache of latent rows `[c_KV, k_R]` (chapter 6);
- `block_pool.BlockPool`, `block_manager.BlockManager`: the paged cache's reference-counted block
  allocator with prefix caching and copy-on-write, and its per-sequence block tables (chapter 7);
- `paged.PagedCache`: K/V in blocks `(num_blocks, block_size, H_kv, D)` per layer, written through
  the slot mapping and read by paged attention (chapter 7);
- `simulate`: a request trace replayed against contiguous and paged caches, every slot accounted
  for (reserved, internal and external fragmentation; chapter 7);
- `evicting.EvictingCache`: a dense cache that keeps at most a budget of tokens per KV head,
  chosen by a policy (`eviction_policies`: `StreamingLLM`, `H2O`, `TOVA`, `SnapKV`,
`RandomEviction`; chapter 8);
- `compaction.CompactingPagedCache`: a paged cache whose sequences evict tokens (a chapter 8
  policy, one decision per sequence) and get their blocks back by compaction: order-preserving
  repack or hole-filling with a slot -> position map (chapter 9);
- `quantized.QuantizedCache`, `quantized.QuantizedPagedCache`: keys and values stored as
  `kvlib.quant` codes and scales (int8, fp8, int4, int2; per token, channel or group), dense
  with a full-precision residual (KIVI) or paged with per-token scales, dequantized next to
  attention (chapter 10);
- `block_table.shuffled_block_tables`: block tables scattered by a busy allocator, for the paged
  decode kernel of chapter 11;
- `paged_bounds.PageBoundsCache`: the paged cache with each block's key minima and maxima kept as
  blocks fill, the page metadata of query-aware sparse attention (`kvlib.sparse`, chapter 15);
- `ring.RingCache`: a sliding-window layer's ring buffer of W slots per sequence, position p in
  slot p mod W, a fixed size whatever the length (chapter 17);
- `paged_window.PagedWindowCache`: the paged cache for a sliding-window model, each sequence's
  blocks that left the window given back to the pool, their table entries pointing at a null
  block (`freeable_blocks`, `free_window_blocks`; chapter 17);
- `hybrid.HybridCache`: a hybrid model's cache, per layer the one its kind needs (dense K/V for
  full attention, a ring for a sliding window, a recurrent state for gated linear attention),
  dispatched by layer index (chapter 17);
- `shared.CrossLayerCache`: cross-layer KV sharing (CLA, Gemma 3n's `num_kv_shared_layers`), the
  sharing layers reading the K/V an earlier layer stored in the same forward (chapter 17);
- `hybrid_blocks.HybridBlockManager`: a hybrid model's allocator, one block table per group of
  layers of one kind over one shared pool, prefix hits that need only a window's blocks in a
  window group (chapter 17; an allocator, not a cache: it holds no K/V).

Each chapter adds a module here and plugs it in; the model's layers do not change.
"""

from kvlib.cache.base import KVCache
from kvlib.cache.compaction import CompactingPagedCache
from kvlib.cache.dense import DynamicCache, StaticCache
from kvlib.cache.evicting import EvictingCache
from kvlib.cache.hybrid import HybridCache
from kvlib.cache.latent import LatentCache
from kvlib.cache.paged import PagedCache
from kvlib.cache.paged_window import PagedWindowCache
from kvlib.cache.quantized import QuantizedCache, QuantizedPagedCache
from kvlib.cache.ring import RingCache
from kvlib.cache.shared import CrossLayerCache

__all__ = [
    "CompactingPagedCache",
    "CrossLayerCache",
    "DynamicCache",
    "EvictingCache",
    "HybridCache",
    "KVCache",
    "LatentCache",
    "PagedCache",
    "PagedWindowCache",
    "QuantizedCache",
    "QuantizedPagedCache",
    "RingCache",
    "StaticCache",
]
