"""Query-aware sparse attention over the paged cache (chapter 15; Quest, Tang et al., ICML 2024),
one concept per module:

- `bounds`: the upper bound on any key's score in a page, from the page's key minima and maxima
  (kept by `kvlib.cache.paged_bounds.PageBoundsCache`); GQA's bound over a group's query heads;
- `selection`: top-k pages per sequence with the sink and newest pages forced in, and the compacted
  block table that hands the selection to chapter 11's kernel;
- `baselines`: the oracle (true attention mass per page) and random page scores;
- `cache`: `SparsePagedCache`, the cache whose decode steps read only the selected pages, through
  `kvlib.kernels.paged_decode_attention` (unchanged).

The bytes the bounds cost, stored and read per step, are chapter 3's equation extended
(`kvlib.memory.sparse`).
"""

from kvlib.sparse.cache import SparsePagedCache

__all__ = ["SparsePagedCache"]
